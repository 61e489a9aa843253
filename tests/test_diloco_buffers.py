"""DiLoCo and a model with buffers (BatchNorm): averaged once a round, or left to each replica.

The reference is ``simulate`` in test_diloco.py (all replicas in one process), which averages the
floating buffers of its replicas when a round's last fragment lands; the negative controls are the
same simulation without that averaging, and the replicas' buffers differing when they are left alone.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync.diloco as diloco
from gradsync import DistributedDataParallel as DDP
from gradsync.elastic_diloco import FaultTolerantDiLoCo
from test_diloco import params_relative, relative, simulate

from harness import run_distributed
from models import global_batch, loss_fn, make_model, rank_world, shard

pytestmark = pytest.mark.timeout(90)

# SGD, not AdamW: the convolutions' biases before BatchNorm get gradients of round-off size, which
# AdamW's normalisation would blow up to full steps, turning the merge's last-bit rounding (lerp
# against the simulation's a * x + (1 - a) * y) into percent-size differences.
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


def bn_batch(world: int, r: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch("cnn_bn", world, t)
    return shard(x, r, world), shard(y, r, world)


def buffers_relative(a: nn.Module, b: nn.Module) -> float:
    return max(relative(x.float(), y.float()) for x, y in zip(a.buffers(), b.buffers()))


def _with_buffers(mode: str, H: int, F: int, delay: int, steps: int) -> dict:
    rank, world = rank_world()
    model = make_model("cnn_bn")
    replicas = [copy.deepcopy(model) for _ in range(world)]
    outer = diloco.DiLoCo(model, SGD(model.parameters()), sync_every=H, fragments=F, delay=delay, buffers=mode)
    # a non-persistent buffer (a mask, a table: derived state) is not averaged, even where replicas differ in it
    model.register_buffer("scratch", torch.full((3,), float(rank)), persistent=False)
    for t in range(steps):
        x, y = bn_batch(world, rank, t)
        outer.zero_grad()
        loss_fn(model(x), y).backward()
        outer.step()
    outer.close()
    batch = functools.partial(bn_batch, world)
    averaged, _ = simulate(
        [copy.deepcopy(m) for m in replicas], SGD, diloco.nesterov, batch, steps, H, F, delay, average_buffers=True
    )
    alone, _ = simulate(replicas, SGD, diloco.nesterov, batch, steps, H, F, delay, average_buffers=False)
    scratch_kept = torch.equal(model.scratch, torch.full((3,), float(rank)))
    del model.scratch
    flat = torch.cat([b.detach().float().reshape(-1) for b in model.buffers() if b.is_floating_point()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return {
        "identical": all(torch.equal(gathered[0], g) for g in gathered),
        "vs_averaged": buffers_relative(model, averaged[rank]),
        "vs_alone": buffers_relative(model, alone[rank]),
        "params_vs_averaged": params_relative(model, averaged[rank]),
        "params_vs_alone": params_relative(model, alone[rank]),
        "scratch_kept": scratch_kept,
        "sent_bytes": outer.buffers.sent_bytes,
    }


# (H, F, delay, steps): each run ends right after the landing of a round's last fragment, the second of the run
RUNS = [(4, 1, 0, 8), (4, 2, 1, 9)]
# per round: two BatchNorm2d(8), each a running mean and variance of 8 fp32 values and one int64 counter
BUFFER_BYTES_PER_ROUND = 2 * (2 * 8 * 4 + 8)


@pytest.mark.parametrize("H,F,delay,steps", RUNS)
def test_buffers_are_averaged_once_a_round_as_the_simulation_does(H: int, F: int, delay: int, steps: int) -> None:
    for r in run_distributed(_with_buffers, 2, "average", H, F, delay, steps, timeout_s=60):
        assert r["identical"], r  # every replica holds the same running statistics after the round
        assert r["vs_averaged"] <= 1e-6 and r["params_vs_averaged"] <= 1e-5, r
        # negative control: without the averaging the statistics are the replica's own, far from these
        assert r["vs_alone"] > 1e-3, r
        assert r["scratch_kept"], r
        assert r["sent_bytes"] == 2 * BUFFER_BYTES_PER_ROUND, r


def test_buffers_local_leaves_each_replica_its_own() -> None:
    for r in run_distributed(_with_buffers, 2, "local", 4, 1, 0, 8, timeout_s=60):
        assert not r["identical"], r
        assert r["vs_alone"] <= 1e-6 and r["params_vs_alone"] <= 1e-5, r
        assert r["vs_averaged"] > 1e-3, r
        assert r["sent_bytes"] == 0, r


def _islands_with_buffers(mode: str) -> dict:
    """2 islands x 2 processes of a BatchNorm CNN. Both members of island i train on the same rows (shard i of
    two), so their local batch statistics agree and the island is exactly the simulation's replica i; with
    members on different rows the island's statistics are its rank 0's, as DDP's buffer broadcast makes them."""
    rank, world = rank_world()
    islands = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    island = rank // 2
    model = make_model("cnn_bn")
    replicas = [copy.deepcopy(model) for _ in range(2)]
    ddp = DDP(model, process_group=islands[island])
    outer = diloco.DiLoCo(ddp, SGD(ddp.parameters()), sync_every=4, buffers=mode)
    steps = 8  # two rounds; the run ends right after the second outer step
    for t in range(steps):
        x, y = bn_batch(2, island, t)
        outer.zero_grad()
        loss_fn(ddp(x), y).backward()
        outer.step()
    outer.close()
    batch = functools.partial(bn_batch, 2)
    copies = [copy.deepcopy(m) for m in replicas]
    averaged, _ = simulate(copies, SGD, diloco.nesterov, batch, steps, 4, average_buffers=True)
    alone, _ = simulate(replicas, SGD, diloco.nesterov, batch, steps, 4, average_buffers=False)
    flat = torch.cat([b.detach().float().reshape(-1) for b in model.buffers() if b.is_floating_point()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    for group in islands:
        dist.destroy_process_group(group)
    return {
        "identical": all(torch.equal(gathered[0], g) for g in gathered),
        "same_island": torch.equal(gathered[2 * island], gathered[2 * island + 1]),
        "vs_averaged": buffers_relative(model, averaged[island]),
        "vs_alone": buffers_relative(model, alone[island]),
        "params_vs_averaged": params_relative(model, averaged[island]),
        "sent_bytes": outer.buffers.sent_bytes,
    }


def test_buffers_over_islands_are_averaged_between_counterparts() -> None:
    for r in run_distributed(_islands_with_buffers, 4, "average", timeout_s=60):
        assert r["identical"], r  # all four processes: both islands hold the average
        assert r["vs_averaged"] <= 1e-6 and r["params_vs_averaged"] <= 1e-5, r
        assert r["vs_alone"] > 1e-3, r  # negative control: the island's own statistics are far from these
        assert r["sent_bytes"] == 2 * BUFFER_BYTES_PER_ROUND, r  # every member averages with its counterpart


def test_buffers_local_over_islands_stay_each_islands_own() -> None:
    for r in run_distributed(_islands_with_buffers, 4, "local", timeout_s=60):
        assert not r["identical"] and r["same_island"], r  # the islands differ; inside one, DDP keeps them equal
        assert r["vs_alone"] <= 1e-6, r
        assert r["vs_averaged"] > 1e-3 and r["sent_bytes"] == 0, r


def _misuse() -> list[str]:
    caught = []
    model = make_model("cnn_bn")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="buffers must be one of"):
        diloco.DiLoCo(model, sgd, 4, buffers="broadcast")
    caught.append("mode")
    # the fault-tolerant mode averages buffers too (tests/test_diloco_elastic.py): a BatchNorm model is taken,
    # and what stops it here is only the missing elastic run
    with pytest.raises(RuntimeError, match="gradsync.elastic.init"):
        FaultTolerantDiLoCo(model, sgd, 4)
    caught.append("fault tolerant")
    with pytest.raises(ValueError, match="buffers must be one of"):
        FaultTolerantDiLoCo(model, sgd, 4, buffers="broadcast")  # its mode is checked before the run is looked up
    caught.append("fault tolerant mode")
    return caught


def test_misuse_names_the_fix() -> None:
    assert run_distributed(_misuse, 2, timeout_s=30)[0] == ["mode", "fault tolerant", "fault tolerant mode"]
