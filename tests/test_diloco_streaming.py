"""Streaming DiLoCo (fragments, delay, merge), the wire, checkpoints, islands and misuse.

The reference for the training math is ``simulate`` in test_diloco.py: all replicas in one process,
one tensor per parameter, the schedule written out from the paper. Bytes are counted twice: by
DiLoCo's ``WireCount`` and, independently, by wrapping ``dist.all_to_all_single``; DDP's by the
``allreduce_hook``'s own ``WireStats``.
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
from gradsync.hooks import AllReduceState, allreduce_hook
from gradsync.zero import ShardedOptimizer
from test_diloco import (
    contiguous_blocks,
    layer_index,
    mlp_batch,
    params_relative,
    relative,
    simulate,
    train_replica,
)

from harness import run_distributed
from models import global_batch, loss_fn, make_model, rank_world, shard

pytestmark = pytest.mark.timeout(90)

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _against_simulation(
    H: int,
    F: int,
    delay: int,
    alpha: float,
    sim_alpha: float,
    merge: str = "mix",
    sim_merge: str = "mix",
    named: bool = False,
    sim_named: bool = False,
) -> float:
    """``named``: DiLoCo is given contiguous_blocks (F = 2) instead of F; ``sim_named``: so is the simulation."""
    rank, world = rank_world()
    model = make_model("mlp")
    replicas = [copy.deepcopy(model) for _ in range(world)]
    fragments = contiguous_blocks(model) if named else F
    outer = diloco.DiLoCo(
        model, ADAMW(model.parameters()), sync_every=H, fragments=fragments, delay=delay, alpha=alpha, merge=merge
    )
    steps = 3 * H + 1
    train_replica(model, outer, range(steps))
    outer.close()
    batch = functools.partial(mlp_batch, world)
    fragment_of = {n: int(i >= 2) for n, i in layer_index(model).items()} if sim_named else None
    simulated, theta = simulate(
        replicas, ADAMW, diloco.nesterov, batch, steps, H, F, delay, sim_alpha, merge=sim_merge, fragment_of=fragment_of
    )
    flat_theta = torch.cat([theta[n].reshape(-1) for n in sorted(theta, key=list(theta).index)])
    ours = torch.cat([p.detach().reshape(-1) for p in outer.global_parameters])
    # theta_global is laid out by fragment; compare it parameter by parameter through the fragments' names
    by_name = dict(
        zip([n for f in outer.fragments for n in f.names], ours.split([s for f in outer.fragments for s in f.sizes]))
    )
    theta_difference = max(relative(by_name[n].view_as(theta[n]), theta[n]) for n in theta)
    assert flat_theta.numel() == ours.numel()
    return max(params_relative(model, simulated[rank]), theta_difference)


@pytest.mark.parametrize("H,F,delay", [(4, 1, 0), (6, 3, 0), (4, 2, 1), (6, 2, 2)])
def test_streaming_diloco_equals_the_naive_simulation(H: int, F: int, delay: int) -> None:
    for difference in run_distributed(_against_simulation, 2, H, F, delay, 0.5, 0.5, timeout_s=30):
        assert difference <= 1e-5, difference


def test_the_merge_is_checked_negative_control() -> None:
    """The simulation without the merge (alpha = 1: keep the local parameters) is far from DiLoCo's."""
    assert min(run_distributed(_against_simulation, 2, 4, 2, 1, 0.5, 1.0, timeout_s=30)) > 1e-3


@pytest.mark.parametrize("H,F,delay", [(4, 2, 1), (6, 2, 2), (6, 3, 1)])
def test_the_merge_that_keeps_the_inner_steps_equals_the_simulation(H: int, F: int, delay: int) -> None:
    """merge="keep_inner_steps": the new theta_global plus the steps taken in flight, the simulation
    copying each replica's fragment when its exchange starts (DiLoCo derives it from what it sent)."""
    args = (H, F, delay, 0.5, 0.5, "keep_inner_steps")
    for difference in run_distributed(_against_simulation, 2, *args, "keep_inner_steps", timeout_s=30):
        assert difference <= 1e-5, difference
    # negative control: the paper's merge in the simulation is far from it
    assert min(run_distributed(_against_simulation, 2, *args, "mix", timeout_s=30)) > 1e-3


@pytest.mark.parametrize("delay", [0, 1])
def test_fragments_the_user_names_equal_the_simulation(delay: int) -> None:
    """fragments=[blocks 0-1, blocks 2-3 + head]: synced as the simulation with that assignment syncs them."""
    args = (4, 2, delay, 0.5, 0.5, "mix", "mix", True)
    for difference in run_distributed(_against_simulation, 2, *args, True, timeout_s=30):
        assert difference <= 1e-5, difference
    if delay:  # negative control: the simulation with the strided assignment is far from it
        assert min(run_distributed(_against_simulation, 2, *args, False, timeout_s=30)) > 1e-3


def _touches(H: int, F: int) -> dict:
    rank, world = rank_world()
    model = make_model("mlp")
    outer = diloco.DiLoCo(model, ADAMW(model.parameters()), sync_every=H, fragments=F)
    names = [n for f in outer.fragments for n in f.names]
    sizes = [s for f in outer.fragments for s in f.sizes]
    touched = {n: [] for n in names}
    before = torch.cat([p.detach().clone().reshape(-1) for p in outer.global_parameters]).split(sizes)
    for t in range(2 * H):
        x, y = mlp_batch(world, rank, t)
        outer.zero_grad()
        loss_fn(model(x), y).backward()
        outer.step()
        after = torch.cat([p.detach().clone().reshape(-1) for p in outer.global_parameters]).split(sizes)
        for n, a, b in zip(names, before, after):
            if not torch.equal(a, b):
                touched[n].append(t + 1)
        before = after
    outer.close()
    fragment_of = {n: f.index for f in outer.fragments for n in f.names}
    return {"touched": touched, "fragment_of": fragment_of, "layers": layer_index(model)}


def test_a_cycle_of_fragment_syncs_touches_every_parameter_once() -> None:
    H, F = 6, 3
    result = run_distributed(_touches, 2, H, F, timeout_s=30)[0]
    touched, fragment_of, layers = result["touched"], result["fragment_of"], result["layers"]
    assert sorted(fragment_of) == sorted(layers)  # every parameter in exactly one fragment
    assert all(fragment_of[n] == layers[n] % F for n in layers)  # strided over the layers
    for n, steps in touched.items():  # each round of H steps changes each parameter's theta_global once,
        assert [(s - 1) // H for s in steps] == [0, 1], (n, steps)  # at its fragment's own offset
        assert all(s % H == (fragment_of[n] + 1) * (H // F) % H for s in steps), (n, steps)
    # negative control: between outer steps theta_global did not move at all (the record is not "always")
    assert sum(len(s) for s in touched.values()) == 2 * len(touched)


class Stack(nn.Module):
    """Four equal layers: fragments of equal size, so 1/F of the model is exact."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _bytes(wire: str, H: int, F: int, delay: int) -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    model, counted = Stack(), {"bytes": 0}
    ddp = DDP(copy.deepcopy(model))
    state = AllReduceState()
    ddp.register_comm_hook(state, allreduce_hook)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    outer = diloco.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.01), H, fragments=F, delay=delay, wire=wire)
    original = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        me = dist.get_rank(group)
        counted["bytes"] += (sum(input_split_sizes) - input_split_sizes[me]) * input.element_size()
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = counting
    try:
        steps = 4 * H
        for t in range(steps):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * t + rank))
            for m, opt in ((model, outer), (ddp, ddp_opt)):
                opt.zero_grad()
                (m(x) - x.flip(1)).pow(2).mean().backward()
                opt.step()
        outer.close()
    finally:
        dist.all_to_all_single = original
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    return {
        "diloco": outer.wire.sent_bytes / steps,
        "independent": counted["bytes"] / steps,
        "ddp": state.wire.mean_bytes_per_iteration(),
        "peak": outer.wire.peak_in_flight_bytes,
        "peak_exchanges": outer.wire.peak_in_flight,
        "model_bytes": model_bytes,
        "numel": model_bytes // 4,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_on_the_wire_per_inner_step(world: int) -> None:
    H = 4
    for r in run_distributed(_bytes, world, "fp32", H, 1, 0, timeout_s=30):
        assert r["diloco"] == r["independent"] > 0
        assert r["ddp"] == 2 * (world - 1) / world * r["model_bytes"]  # the hook's ring count, for scale
        assert r["diloco"] <= r["ddp"] / H, r  # fp32: an all-reduce's bytes once every H steps
    for r in run_distributed(_bytes, world, "int8", H, 2, 1, timeout_s=30):
        assert r["diloco"] == r["independent"] > 0
        # int8: a quarter of fp32, plus 4 bytes of scale per chunk of 1024 values (and per piece's ragged end)
        pieces = 2 * world  # 2 fragments, each cut into `world` pieces
        scale_bytes = 4 * (r["numel"] // 1024 + pieces)
        assert r["diloco"] <= (r["ddp"] / (4 * H)) * (1 + scale_bytes / r["numel"]), r
        assert r["diloco"] > r["ddp"] / (4 * H)  # negative control: the scales are counted, not left out
        # peak bytes in flight: one fragment at a time, each 1/F of the model (int8: 1/4 of that, plus scales)
        assert r["peak_exchanges"] == 1
        assert r["peak"] <= r["model_bytes"] / 2 / 4 + scale_bytes, r
    for r in run_distributed(_bytes, world, "int4", H, 2, 1, timeout_s=30):
        assert r["diloco"] == r["independent"] > 0
        # int4: an eighth of fp32, plus 4 bytes of scale per chunk of 256 values and half a byte of padding per
        # piece (each a chunk of its own at the ends), over the payload's numel / 2 bytes
        pieces = 2 * world
        extra = 4 * (r["numel"] // 256 + pieces) + pieces
        assert r["diloco"] <= (r["ddp"] / (8 * H)) * (1 + extra / (r["numel"] / 2)), r
        assert r["diloco"] > r["ddp"] / (8 * H)  # negative control: the scales are counted
        assert r["peak"] <= r["model_bytes"] / 2 / 8 + extra, r


def _train_and_save(
    H: int,
    F: int,
    delay: int,
    wire: str,
    stop: int,
    total: int,
    load: bool,
    merge: str = "mix",
    error_feedback: bool = False,
    drop_residuals: bool = False,
) -> list[torch.Tensor]:
    model = make_model("mlp")
    inner = ADAMW(model.parameters())
    knobs = {"fragments": F, "delay": delay, "wire": wire, "merge": merge, "error_feedback": error_feedback}
    outer = diloco.DiLoCo(model, inner, sync_every=H, **knobs)
    train_replica(model, outer, range(stop))
    if stop < total:
        saved = copy.deepcopy({"model": model.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()})
        outer.close()
        model = make_model("mlp", seed=123)  # other weights: everything must come from the checkpoint
        inner = ADAMW(model.parameters())
        outer = diloco.DiLoCo(model, inner, sync_every=H, **knobs)
        if drop_residuals:  # the negative control of error feedback's resume
            saved["outer"]["error_feedback"] = [
                {k: torch.zeros_like(v) for k, v in r.items()} for r in saved["outer"]["error_feedback"]
            ]
            saved["outer"]["in_flight"]["residuals"] = None
        model.load_state_dict(saved["model"])
        inner.load_state_dict(saved["inner"])
        if load:
            outer.load_state_dict(saved["outer"])
        train_replica(model, outer, range(stop, total))
    outer.close()
    return [p.detach().clone() for p in list(model.parameters()) + outer.global_parameters]


@pytest.mark.parametrize("merge", ["mix", "keep_inner_steps"])
def test_a_resumed_run_continues_bitwise(merge: str) -> None:
    """Saved at step 6, while fragment 0's exchange (started after step 6, delay 1) is in flight."""
    args = (4, 2, 1, "int8")
    whole = run_distributed(_train_and_save, 2, *args, 14, 14, True, merge, timeout_s=30)
    resumed = run_distributed(_train_and_save, 2, *args, 6, 14, True, merge, timeout_s=30)
    for a, b in zip(whole, resumed):
        assert all(torch.equal(p, q) for p, q in zip(a, b))
    # negative control: the same resume without DiLoCo's own state (theta_global, momentum, step) differs
    fresh = run_distributed(_train_and_save, 2, *args, 6, 14, False, merge, timeout_s=30)
    assert not all(torch.equal(p, q) for p, q in zip(whole[0], fresh[0]))


def _island_rows(i: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Island ``i``'s rows at inner step ``t``: half of a 16-row batch (two islands); its members split them."""
    x, y = global_batch("mlp", 4, t)
    return shard(x, i, 2), shard(y, i, 2)


def _against_two_replicas(
    outer: diloco.DiLoCo,
    model: nn.Module,
    island: int,
    islands: list,
    steps: int,
    steps_of: list[int] | None = None,
    by_contributors: bool = True,
) -> dict:
    """After training two islands: ``outer`` closed, ``theta_global`` compared across every process, this
    island's parameters against the one-process simulation of the two islands as two replicas (plain AdamW
    from the same start; ``steps_of``: each island's steps, inside ``outer.join()``, averaged over the
    contributors or, ``by_contributors=False``, over both), the groups destroyed."""
    outer.close()
    flat = torch.cat([p.detach().reshape(-1) for p in outer.global_parameters])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    replicas = [make_model("mlp") for _ in range(2)]  # every test here starts from make_model("mlp")'s weights
    H, F, delay = outer.schedule.sync_every, outer.schedule.fragments, outer.schedule.delay
    simulated, _ = simulate(
        replicas, ADAMW, diloco.nesterov, _island_rows, steps, H, F, delay, 0.5, steps_of, by_contributors
    )
    for group in islands:
        dist.destroy_process_group(group)
    return {
        "identical": all(torch.equal(gathered[0], g) for g in gathered),
        "difference": params_relative(model, simulated[island]),
        "other_island": params_relative(model, simulated[1 - island]),
        "sent": outer.wire.sent_bytes,
        "island_bytes": outer.wire.island_bytes,
        "numel": flat.numel(),
    }


def _islands(micro: int) -> dict:
    rank, world = rank_world()
    islands = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    island, member = rank // 2, rank % 2
    model = make_model("mlp")
    ddp = DDP(model, process_group=islands[island])
    ddp.register_comm_hook(AllReduceState(islands[island]), allreduce_hook)  # a comm hook inside the island
    outer = diloco.DiLoCo(ddp, ADAMW(ddp.parameters()), sync_every=3, fragments=1, delay=1 if micro == 1 else 0)
    steps = 7
    for t in range(steps):
        x, y = _island_rows(island, t)  # island i trains on rows of members 2i, 2i+1
        x, y = shard(x, member, 2), shard(y, member, 2)
        outer.zero_grad()
        for m in range(micro):  # gradient accumulation inside the island: no_sync, then a synced backward
            part = slice(m * 4 // micro, (m + 1) * 4 // micro)
            if m < micro - 1:
                with ddp.no_sync():
                    (loss_fn(ddp(x[part]), y[part]) / micro).backward()
            else:
                (loss_fn(ddp(x[part]), y[part]) / micro).backward()
        outer.step()
    return {**_against_two_replicas(outer, model, island, islands, steps), "member": member}


@pytest.mark.parametrize("micro", [1, 2])
def test_islands_of_ddp_exchange_slices_and_match_the_simulation(micro: int) -> None:
    """2 islands x 2 processes: DDP (with a comm hook, and no_sync accumulation) inside, DiLoCo across."""
    results = run_distributed(_islands, 4, micro, timeout_s=60)
    for r in results:
        assert r["identical"], r
        assert r["difference"] <= 1e-5, r
        assert r["other_island"] > 1e-4  # negative control: the islands' own replicas differ
        # each member carries only its slice (half) of the fp32 outer gradient across the islands: per exchange
        # (2 in 7 steps) it sends its counterpart one half of the slice and then the other, averaged
        n = r["numel"]
        slice_values = n // 2 + (1 if r["member"] < n % 2 else 0)
        assert r["sent"] == 2 * 4 * slice_values, r
        assert r["island_bytes"] == 2 * 4 * slice_values, r  # and hands its averaged slice to its island mate


def _islands_with_zero(stage: int, delay: int) -> dict:
    """2 islands x 2 processes, gradsync.zero's ShardedOptimizer (AdamW) inside each island, DiLoCo across."""
    rank, world = rank_world()
    islands = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    island, member = rank // 2, rank % 2
    model = make_model("mlp")
    ddp = DDP(model, process_group=islands[island])
    inner = ShardedOptimizer(ddp, torch.optim.AdamW, stage=stage, lr=1e-2, weight_decay=0.1)  # ADAMW's settings
    outer = diloco.DiLoCo(ddp, inner, sync_every=3, fragments=1, delay=delay)
    steps = 7
    for t in range(steps):
        x, y = _island_rows(island, t)
        x, y = shard(x, member, 2), shard(y, member, 2)
        outer.zero_grad()
        loss_fn(ddp(x), y).backward()
        outer.step()  # the shards' all-gathers are in flight after it, outer steps included
    inner.wait_for_params()
    return _against_two_replicas(outer, model, island, islands, steps)


@pytest.mark.parametrize("stage, delay", [(2, 0), (1, 1), (2, 1)])
def test_zero_inside_islands_matches_the_simulation(stage: int, delay: int) -> None:
    """The inner optimizer sharded over each island: its all-gathers after every step are finished before an
    outer step reads or writes the parameters; the result is the two-replica simulation with plain AdamW."""
    for r in run_distributed(_islands_with_zero, 4, stage, delay, timeout_s=60):
        assert r["identical"], r
        assert r["difference"] <= 1e-5, r
        assert r["other_island"] > 1e-4, r  # negative control: the islands' own replicas differ


def _unequal_islands(layout: tuple[tuple[int, ...], ...], delay: int, error_feedback: bool) -> dict:
    """Islands of unequal size, each training on its own rows (split evenly among its members)."""
    rank, world = rank_world()
    islands = [dist.new_group(list(ranks)) for ranks in layout]
    island = next(i for i, ranks in enumerate(layout) if rank in ranks)
    members = layout[island]
    model = make_model("mlp", seed=rank)  # different starting weights: DiLoCo must make them one (rank 0's)
    ddp = DDP(model, process_group=islands[island])
    wire = "int8" if error_feedback else "fp32"
    knobs = {"fragments": 1, "delay": delay, "wire": wire, "error_feedback": error_feedback}
    outer = diloco.DiLoCo(ddp, ADAMW(ddp.parameters()), sync_every=3, **knobs)
    steps = 7
    for t in range(steps):
        x, y = _island_rows(island, t)
        x, y = shard(x, members.index(rank), len(members)), shard(y, members.index(rank), len(members))
        outer.zero_grad()
        loss_fn(ddp(x), y).backward()
        outer.step()
    result = _against_two_replicas(outer, model, island, islands, steps)
    return {**result, "has_counterparts": members.index(rank) < min(len(ranks) for ranks in layout)}


@pytest.mark.parametrize(
    "layout, delay, error_feedback",
    [(((0,), (1, 2)), 0, False), (((0, 1), (2,)), 1, False), (((0, 1), (2,)), 1, True)],
    ids=["1+2", "2+1-streaming", "2+1-int8-feedback"],
)
def test_islands_of_unequal_size_match_the_simulation(layout, delay: int, error_feedback: bool) -> None:
    """One island of one process and one of two: every island is one replica of the average; the larger
    island's second member has no counterpart, sends nothing across and still ends with the average."""
    results = run_distributed(_unequal_islands, 3, layout, delay, error_feedback, timeout_s=60)
    for r in results:
        assert r["identical"], r
        assert r["other_island"] > 1e-4, r  # negative control: the islands' own replicas differ
        assert (r["sent"] > 0) == r["has_counterparts"], r  # only members with counterparts use the slow link
        # the simulation is fp32; int8 (with its feedback) rounds what it sends, so it is only close
        assert r["difference"] <= (5e-3 if error_feedback else 1e-5), r
        if r["has_counterparts"] and not error_feedback:  # slices = 1 (the smallest island): the whole outer
            assert r["sent"] == 2 * 4 * r["numel"], r  # gradient, half then the averaged half, in 2 exchanges
    assert sum(r["has_counterparts"] for r in results) == 2


def _unequal_islands_join(by_contributors: bool) -> dict:
    """Islands of 1 and 2 processes with uneven data inside ``outer.join()``: the larger island's member
    without counterparts learns from its island who contributed."""
    rank, world = rank_world()
    layout = ((0,), (1, 2))
    islands = [dist.new_group(list(ranks)) for ranks in layout]
    island = 0 if rank == 0 else 1
    members = layout[island]
    steps_of = [9, 14]  # the one-process island runs out of data first
    model = make_model("mlp")
    ddp = DDP(model, process_group=islands[island])
    outer = diloco.DiLoCo(ddp, ADAMW(ddp.parameters()), sync_every=4, fragments=2, delay=1)
    with outer.join():
        for t in range(steps_of[island]):
            x, y = _island_rows(island, t)
            x, y = shard(x, members.index(rank), len(members)), shard(y, members.index(rank), len(members))
            outer.zero_grad()
            loss_fn(ddp(x), y).backward()
            outer.step()
    end = outer.step_count
    return {**_against_two_replicas(outer, model, island, islands, 0, steps_of, by_contributors), "end": end}


def test_join_over_islands_of_unequal_size_averages_over_the_islands_that_contributed() -> None:
    results = run_distributed(_unequal_islands_join, 3, True, timeout_s=60)
    assert len({r["end"] for r in results}) == 1, results  # every process left join() after the same exchange
    for r in results:
        assert r["identical"] and r["difference"] <= 1e-5, r
    # negative control: dividing by both islands (the finished one counted as a zero outer gradient) is far off
    assert min(r["difference"] for r in run_distributed(_unequal_islands_join, 3, False, timeout_s=60)) > 1e-4


def _misuse() -> list[str]:
    rank, world = rank_world()
    caught = []

    def expect(error: type, match: str, build) -> None:
        with pytest.raises(error, match=match):
            build()
        caught.append(match)

    model = make_model("mlp")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    expect(ValueError, "multiple of fragments", lambda: diloco.DiLoCo(model, sgd, 10, fragments=3))
    expect(ValueError, "delay=5", lambda: diloco.DiLoCo(model, sgd, 10, fragments=2, delay=5))
    expect(ValueError, "fragments=6", lambda: diloco.DiLoCo(model, sgd, 12, fragments=6))
    expect(TypeError, "comm hook", lambda: diloco.DiLoCo(model, sgd, 4, wire=allreduce_hook))
    expect(ValueError, "wire must be one of", lambda: diloco.DiLoCo(model, sgd, 4, wire="fp8"))
    expect(ValueError, "alpha", lambda: diloco.DiLoCo(model, sgd, 4, alpha=1.5))
    expect(ValueError, "merge", lambda: diloco.DiLoCo(model, sgd, 4, delay=1, merge="average"))
    expect(ValueError, "not used by merge", lambda: diloco.DiLoCo(model, sgd, 4, alpha=0.3, merge="keep_inner_steps"))
    expect(TypeError, "callable", lambda: diloco.DiLoCo(model, sgd, 4, outer_optimizer=0.7))
    other = make_model("mlp")
    expect(
        ValueError,
        "not parameters of DiLoCo's model",
        lambda: diloco.DiLoCo(model, torch.optim.SGD(other.parameters(), lr=1), 4),
    )
    torch_ddp = nn.parallel.DistributedDataParallel(make_model("mlp"))
    expect(TypeError, "torch's DistributedDataParallel", lambda: diloco.DiLoCo(torch_ddp, sgd, 4))
    whole = DDP(make_model("mlp"))
    expect(ValueError, "only one island", lambda: diloco.DiLoCo(whole, torch.optim.SGD(whole.parameters(), lr=1), 4))
    sharded_ddp = DDP(make_model("mlp"))
    sharded = ShardedOptimizer(sharded_ddp, torch.optim.SGD, lr=0.1)
    expect(ValueError, "needs the island's gradsync", lambda: diloco.DiLoCo(sharded_ddp.module, sharded, 4))
    expect(ValueError, "only one island", lambda: diloco.DiLoCo(sharded_ddp, sharded, 4))
    differs = r"ranks \[1\] differ from rank 0 in \['sync_every'\]"
    expect(ValueError, differs, lambda: diloco.DiLoCo(model, sgd, 4 + rank))  # not a hang
    saved = diloco.DiLoCo(model, sgd, 4).state_dict()
    other_outer = diloco.DiLoCo(model, sgd, 4, fragments=2)
    expect(ValueError, r"\['fragment_parameters', 'fragments'\]", lambda: other_outer.load_state_dict(saved))
    expect(TypeError, "pass a list of submodules", lambda: diloco.DiLoCo(model, sgd, 4, fragments=model.layers))
    expect(ValueError, "are in none", lambda: diloco.DiLoCo(model, sgd, 4, fragments=[model.layers]))
    stepped = diloco.DiLoCo(model, sgd, 4)
    x, y = mlp_batch(world, rank, 0)
    loss_fn(model(x), y).backward()
    stepped.step()  # one inner step of four: nothing in flight, but too late to swap the exchange
    expect(RuntimeError, "before the first step", lambda: stepped.replace_exchange(stepped.exchange))
    return caught


def test_misuse_raises_errors_that_name_the_fix() -> None:
    assert len(run_distributed(_misuse, 2, timeout_s=30)[0]) == 19


def _inner_steps_do_no_outer_work(H: int) -> list[int]:
    rank, world = rank_world()
    model = make_model("mlp")
    outer = diloco.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.01), H, fragments=2)
    calls = []
    for fragment in outer.fragments:  # any flat copy of a fragment goes through local()
        original = fragment.local
        fragment.local = lambda dtype=None, original=original: calls.append(outer.step_count) or original(dtype)
    for t in range(2 * H):
        x, y = mlp_batch(world, rank, t)
        outer.zero_grad()
        loss_fn(model(x), y).backward()
        outer.step()
    outer.close()
    return calls


def test_inner_steps_between_outer_steps_touch_no_fragment() -> None:
    """Fragments are flattened only at the steps the schedule names (H=4, F=2: a start every 2 steps)."""
    for calls in run_distributed(_inner_steps_do_no_outer_work, 2, 4, timeout_s=30):
        assert calls == [2, 4, 6, 8], calls


def _uneven(H: int, F: int, delay: int, by_contributors: bool) -> dict:
    rank, world = rank_world()
    steps_of = [9 + 5 * r for r in range(world)]  # rank 0 runs out of data first
    model = make_model("mlp")
    replicas = [copy.deepcopy(model) for _ in range(world)]
    outer = diloco.DiLoCo(model, ADAMW(model.parameters()), sync_every=H, fragments=F, delay=delay)
    with outer.join():
        for t in range(steps_of[rank]):
            x, y = mlp_batch(world, rank, t)
            outer.zero_grad()
            loss_fn(model(x), y).backward()
            outer.step()
    end = outer.step_count
    outer.close()
    batch = functools.partial(mlp_batch, world)
    simulated, _ = simulate(
        replicas, ADAMW, diloco.nesterov, batch, 0, H, F, delay, 0.5, steps_of, by_contributors=by_contributors
    )
    flat = torch.cat([p.detach().reshape(-1) for p in outer.global_parameters])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return {
        "difference": params_relative(model, simulated[rank]),
        "identical": all(torch.equal(gathered[0], g) for g in gathered),
        "end": end,
    }


@pytest.mark.parametrize("world,H,F,delay", [(2, 4, 1, 0), (3, 4, 2, 1)])
def test_join_with_uneven_inputs_averages_over_the_replicas_that_contributed(world: int, H: int, F: int, delay: int):
    results = run_distributed(_uneven, world, H, F, delay, True, timeout_s=30)
    assert len({r["end"] for r in results}) == 1  # every replica left join() after the same exchange
    for r in results:
        assert r["identical"] and r["difference"] <= 1e-5, r
    # negative control: dividing by every replica (a finished one counted as a zero outer gradient) is far off
    wrong = run_distributed(_uneven, world, H, F, delay, False, timeout_s=30)
    assert min(r["difference"] for r in wrong) > 1e-4


def _failing_exchange(delay: int) -> str:
    rank, world = rank_world()
    model = make_model("mlp")
    outer = diloco.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.01), 4, fragments=2, delay=delay)
    original = dist.all_to_all_single

    def broken(*args, **kwargs):
        raise RuntimeError("injected: connection reset by peer")

    dist.all_to_all_single = broken  # on every rank, so no rank waits for a partner that will not come
    try:
        with pytest.raises(RuntimeError) as caught:
            for t in range(4):
                x, y = mlp_batch(world, rank, t)
                outer.zero_grad()
                loss_fn(model(x), y).backward()
                outer.step()
    finally:
        dist.all_to_all_single = original
    assert outer.step_count == 2 + delay  # raised where fragment 0 lands, not later
    outer.close()
    return str(caught.value)


@pytest.mark.parametrize("delay", [0, 1])
def test_a_failed_exchange_raises_where_it_lands_naming_fragment_and_step(delay: int) -> None:
    for message in run_distributed(_failing_exchange, 2, delay, timeout_s=30):
        assert "outer exchange of fragment 0 (started after inner step 2) failed on rank" in message, message
        assert "injected: connection reset by peer" in message


def _resume_without_sent(merge: str) -> str:
    """A checkpoint saved with an exchange in flight, its outer gradient dropped as an older gradsync saved it."""
    model = make_model("mlp")
    outer = diloco.DiLoCo(model, ADAMW(model.parameters()), sync_every=4, fragments=2, delay=1)
    train_replica(model, outer, range(6))  # fragment 0's exchange starts after step 6 and lands after 7
    saved = copy.deepcopy(outer.state_dict())
    outer.close()
    assert saved["in_flight"] is not None and saved["in_flight"]["sent"] is not None
    del saved["in_flight"]["sent"]
    resumed = diloco.DiLoCo(model, ADAMW(model.parameters()), sync_every=4, fragments=2, delay=1, merge=merge)
    try:
        resumed.load_state_dict(saved)
        train_replica(model, resumed, range(6, 8))  # lands the held exchange
        return "resumed"
    except ValueError as error:
        return str(error)
    finally:
        resumed.close()


def test_a_checkpoint_without_the_sent_outer_gradient_resumes_only_with_mix() -> None:
    refused = run_distributed(_resume_without_sent, 2, "keep_inner_steps", timeout_s=30)
    assert all("saved by an older gradsync" in r and "merge='mix'" in r for r in refused), refused
    assert run_distributed(_resume_without_sent, 2, "mix", timeout_s=30) == ["resumed", "resumed"]
