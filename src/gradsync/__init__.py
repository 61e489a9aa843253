"""gradsync: a pure-Python DistributedDataParallel for PyTorch."""

from .ddp import DistributedDataParallel
from .grad_bucket import GradBucket
from .naive import NaiveDataParallel

__all__ = ["DistributedDataParallel", "GradBucket", "NaiveDataParallel"]
__version__ = "0.1.0"
