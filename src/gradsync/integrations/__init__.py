"""Adapters that plug gradsync into training frameworks, one module per framework.

Nothing here is imported by ``import gradsync``: each module imports its framework, so
import the one you use, e.g. ``from gradsync.integrations.lightning import GradsyncDDPStrategy``.
"""
