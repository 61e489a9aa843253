import os
import sys

# Workers are spawned processes: they find the test modules and the harness through
# this path, which spawn hands down to them.
sys.path.insert(0, os.path.dirname(__file__))
