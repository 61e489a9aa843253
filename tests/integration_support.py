"""What the framework integration tests (tests/test_integration_*.py) share.

Each runs all its scenarios in one pair of fresh workers, once with torch's DDP and once with
gradsync's, and compares the results bitwise; these are the pieces every one of them needs.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

import gradsync


@contextmanager
def gradsync_installed() -> Iterator[None]:
    """torch's DDP builds gradsync's inside, torch's own again after (also on failure)."""
    gradsync.install()
    try:
        yield
    finally:
        gradsync.uninstall()


def as_under_torchrun() -> None:
    """What torchrun sets for a worker: frameworks detect a multi-process CPU run from it."""
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, OMP_NUM_THREADS="1")


def run_each(names: Iterable[str], scenario: Callable[[str, str], dict[str, Any]], root: str) -> dict[str, Any]:
    """``{name: scenario(name, root)}``; a scenario that raises reports its traceback, the rest still run."""
    torch.set_num_threads(1)
    as_under_torchrun()
    results = {}
    for name in names:
        try:
            results[name] = scenario(name, root)
        except Exception:  # noqa: BLE001 - that scenario's test reports it; the others still run
            results[name] = {"error": traceback.format_exc()}
    return results


def assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys {sorted(a)} != {sorted(b)}"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs by {(a[k] - b[k]).abs().max():.3g}"


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def scenario_ranks(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Every rank's result of scenario ``name``; a rank that raised fails the test with its traceback."""
    ranks = [r[name] for r in results]
    for rank, r in enumerate(ranks):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return ranks


def assert_built_by(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """The gradsync run built gradsync's wrapper and the torch run torch's (so uninstall worked)."""
    assert ours["type"] == "gradsync.ddp.DistributedDataParallel", ours["type"]
    assert theirs["type"] == "torch.nn.parallel.distributed.DistributedDataParallel", theirs["type"]


def quiet_cpu_trainer(devices: int, root: str) -> dict[str, Any]:
    """Lightning ``Trainer`` arguments for a test: CPU, one node, nothing logged, saved or shown, no sanity
    check, no sampler of Lightning's own (it would shuffle the training set)."""
    return {
        "accelerator": "cpu",
        "devices": devices,
        "num_nodes": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": root,
        "use_distributed_sampler": False,
    }
