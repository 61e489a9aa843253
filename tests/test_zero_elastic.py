"""A sharded optimizer under the fault-tolerant mode (gradsync.elastic).

[Note: a sharded optimizer under the fault-tolerant mode] in elastic/sharded_state.py: while
nothing fails the steps commit as with any optimizer (checked against a single-process replay
of the committed batches); when a rank dies its shards are gone, and the survivors stop with an
error naming them and how to resume, instead of training on with a hole in the optimizer state.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic_support import ElasticJob, max_difference, replay

STEPS = 8
pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_steps_commit_like_a_single_process_replay(stage: int, tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, f"zero-{stage}", replicas=3, steps=STEPS, sharded=stage)
    names = ["a", "b", "c"]
    for name in names:
        job.start(name)
    results = job.finish(names, timeout_s=90)
    assert all(r["step"] == STEPS and r["world_size"] == 3 and r["identical"] for r in results), results
    assert len({r["fingerprint"] for r in results}) == 1
    reference = replay(tmp_path, STEPS)
    for name in names:
        assert max_difference(reference, torch.load(tmp_path / f"{name}.pt")) < 1e-5


def test_a_dead_rank_s_shards_are_named_with_how_to_resume(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, "zero-dead", replicas=3, steps=STEPS, sharded=2)
    job.start_with_last_failing(["a", "b"], "c", fault="backward:4")  # the victim is rank 2
    try:
        for name in ("a", "b"):
            assert job.wait_for_exit(name, timeout_s=90) != 0, job.log(name)
            log = job.log(name)
            assert "Rank(s) [2] of generation 0 died at step 4" in log, log[-3000:]
            assert "rank 2's (" in log and "cannot be healed" in log
            assert "with 2 rank(s)" in log and "gradsync.zero.load_sharded" in log
    finally:
        job.kill_all()
