"""gradsync: a pure-Python DistributedDataParallel for PyTorch."""

from .ddp import DistributedDataParallel
from .grad_bucket import GradBucket
from .naive import NaiveDataParallel
from .stats import BucketInfo, DDPStats
from .sync_batchnorm import SyncBatchNorm
from .trace import trace

convert_sync_batchnorm = SyncBatchNorm.convert_sync_batchnorm

__all__ = [
    "BucketInfo",
    "DDPStats",
    "DistributedDataParallel",
    "GradBucket",
    "NaiveDataParallel",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "trace",
]
__version__ = "0.1.0"
