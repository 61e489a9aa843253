"""Profiler labels (``gradsync::forward``, ``gradsync::reduce_bucket``, ...) that cost nothing when unused.

``torch.profiler.record_function`` dispatches an op on enter and exit even when no profiler
is recording: about 6 µs a label here, several times per iteration. We open a label only
while a profiler (autograd's or ``torch.profiler``'s) is active; one started mid-iteration
sees labels from the next section on.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

_NO_LABEL = contextlib.nullcontext()  # stateless, so one instance serves every call


def label(name: str) -> AbstractContextManager[object]:
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _NO_LABEL
