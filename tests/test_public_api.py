"""The public API: every name users import works, from the path they import it from.

The list is the API as it stood before the packages were split by layer (issue #19), plus what was
added since (``gradsync.zero``, #20); removing or moving a name must fail here. Modules below the entry points
(``gradsync.engine``, ``gradsync.wrapper``, ...) are internal and may move.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PUBLIC = {
    "gradsync": [
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
        "__version__",
    ],
    "gradsync.hooks": [
        "AllReduceState",
        "BucketMemory",
        "Int8State",
        "PowerSGDState",
        "TopKState",
        "WireStats",
        "allreduce_hook",
        "batched_powersgd_hook",
        "bf16_compress_hook",
        "compress_wrapper",
        "fp16_compress_hook",
        "int8_hook",
        "powersgd_hook",
        "topk_hook",
    ],
    "gradsync.elastic": ["ElasticRun", "EtcdStore", "EtcdUnavailable", "FaultTolerant", "Generation", "init", "serve"],
    "gradsync.zero": ["ShardedOptimizer", "load_sharded", "save_sharded"],
    "gradsync.integrations.lightning": ["GradsyncDDPStrategy", "GradsyncFabricDDPStrategy"],
    # Modules people import by path (docs, examples, python -m).
    "gradsync.ddp": ["DistributedDataParallel"],
    "gradsync.naive": ["NaiveDataParallel"],
    "gradsync.sync_batchnorm": ["SyncBatchNorm"],
    "gradsync.run": ["main"],
    "gradsync.elastic.store": ["main", "serve", "connect"],
    "gradsync.hooks.allreduce": ["allreduce_hook", "AllReduceState"],
    "gradsync.hooks.compression": ["fp16_compress_hook", "bf16_compress_hook", "compress_wrapper"],
    "gradsync.hooks.powersgd": ["PowerSGDState", "powersgd_hook", "batched_powersgd_hook"],
    "gradsync.hooks.quantize": ["Int8State", "int8_hook"],
    "gradsync.hooks.topk": ["TopKState", "topk_hook"],
    "gradsync.hooks.wire": ["WireStats"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_public_name_imports(module: str) -> None:
    imported = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lost {missing}"
    for name in PUBLIC[module]:
        exec(f"from {module} import {name}", {})


def test_all_lists_exactly_the_public_names() -> None:
    for module in ("gradsync", "gradsync.hooks", "gradsync.elastic", "gradsync.zero"):
        listed = set(importlib.import_module(module).__all__)
        assert listed == set(PUBLIC[module]) - {"__version__"}, module


def test_public_classes_are_what_they_were() -> None:
    import torch

    import gradsync

    assert issubclass(gradsync.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel)
    assert gradsync.DistributedDataParallel.__module__ == "gradsync.ddp"  # pickles and type checks name it
    assert gradsync.convert_sync_batchnorm == gradsync.SyncBatchNorm.convert_sync_batchnorm
    assert callable(gradsync.install) and importlib.import_module("gradsync.install").install is gradsync.install


def test_entry_point_modules_run_with_python_m() -> None:
    """``python -m gradsync.run`` prints its usage; ``python -m gradsync.elastic.store --help`` too,
    without runpy's warning that the package imported its own ``__main__`` module first."""
    for args, expected in (
        (["gradsync.run"], "usage: python -m gradsync.run"),
        (["gradsync.elastic.store", "--help"], "--port"),
    ):
        out = subprocess.run(
            [sys.executable, "-W", "error::RuntimeWarning", "-m", *args], capture_output=True, text=True, timeout=120
        )
        assert expected in out.stdout + out.stderr, out.stdout + out.stderr
        assert "RuntimeWarning" not in out.stderr, out.stderr
