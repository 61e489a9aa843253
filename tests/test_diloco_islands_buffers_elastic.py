"""Fault-tolerant DiLoCo over unequal islands with BatchNorm: the round's buffer average runs over the
counterpart groups only ([Note: buffers in a decided exchange] in elastic_diloco/committed_exchange.py).

Islands of 1 and 2 processes: island B's member 1 has no counterpart in A (its topology's ``outer`` is
None). It keeps its own buffers, as DiLoCo's ``_average_buffers`` does; were it to average them over the
whole default group instead, its all-gather would meet the others' vote there, and no outer step would
commit with both islands. Checked against what the workers saved (tests/jobs/diloco_worker.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diloco_elastic_support import H, read_logs
from island_support import IslandJob

pytestmark = pytest.mark.timeout(180)

BN = "1."  # the BatchNorm1d in diloco_worker.make_model(batchnorm=True)
STATS = ("running_mean", "running_var", "num_batches_tracked")  # its buffers (its weight and bias are parameters)


def test_unequal_islands_average_batchnorm_buffers_across_counterparts_only(tmp_path: Path) -> None:
    job = IslandJob(tmp_path, "islands-bn", None, replicas=2, sync_every=H, steps=2 * H, batchnorm="")
    job.start_island("A", 0, 1)
    job.wait_arrivals(1)
    job.start_island("B", 1, 2)
    results = job.finish_islands(["A", "B"], timeout_s=150)
    by_name = {r["name"]: r for r in results}
    assert sorted(by_name) == ["A-m0-r0", "B-m0-r0", "B-m1-r0"], sorted(by_name)
    # Nothing failed: every outer step committed with both islands at its first try, and no reconfiguration.
    logs = read_logs(tmp_path)
    assert len(logs.commits) == 2 and all(len(c) == 2 for c in logs.commits.values()), logs.commits
    assert all(r["redone"] == 0 and len(r["history"]) == 0 for r in results), results
    assert all(r["identical"] for r in results), results
    # The run ends at the landing of a round's last fragment: the counterparts A-m0 and B-m0 hold their
    # buffers' average (counters: A-m0's, the group's rank 0), B-m1 its own from its last forward.
    buffers = {name: _buffers(tmp_path / f"{name}.pt") for name in by_name}
    a, b0, b1 = buffers["A-m0-r0"], buffers["B-m0-r0"], buffers["B-m1-r0"]
    assert set(a) == {f"{BN}running_mean", f"{BN}running_var", f"{BN}num_batches_tracked"}, sorted(a)
    for name in a:
        assert torch.equal(a[name], b0[name]), name
    # Negative control: B-m1's statistics differ (its own batches), so the equality above is no accident
    # of buffers that never moved.
    assert not torch.equal(b0[f"{BN}running_mean"], b1[f"{BN}running_mean"])
    assert not torch.equal(a[f"{BN}running_mean"], torch.zeros_like(a[f"{BN}running_mean"]))


def _buffers(path: Path) -> dict[str, torch.Tensor]:
    model = torch.load(path, weights_only=True)["model"]
    return {name: value for name, value in model.items() if name.startswith(BN) and name.split(".")[-1] in STATS}
