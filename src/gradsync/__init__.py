"""gradsync: a pure-Python DistributedDataParallel for PyTorch."""

from . import (
    diloco,  # noqa: F401 - gradsync.diloco.DiLoCo after `import gradsync`
    zero,  # noqa: F401 - gradsync.zero.ShardedOptimizer after `import gradsync`
)
from .ddp import DistributedDataParallel
from .engine.grad_bucket import GradBucket
from .install import install, installed, uninstall
from .install import install_from_env as _install_from_env
from .naive import NaiveDataParallel
from .observability.stats import BucketInfo, DDPStats
from .observability.trace import trace
from .sync_batchnorm import SyncBatchNorm

convert_sync_batchnorm = SyncBatchNorm.convert_sync_batchnorm

__all__ = [
    "BucketInfo",
    "DDPStats",
    "DistributedDataParallel",
    "GradBucket",
    "NaiveDataParallel",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "install",
    "installed",
    "trace",
    "uninstall",
]
__version__ = "0.1.0"

# GRADSYNC_INSTALL=1: a launch script asks for install() without calling it (install.py).
_install_from_env()
