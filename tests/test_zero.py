"""``gradsync.zero.ShardedOptimizer`` (ZeRO-1/2) against gradsync DDP with the same unsharded torch optimizer.

Both train in the same processes, from the same weights, on the same batches; the reference is
DDP + an ordinary ``torch.optim`` optimizer, which tests/test_parity.py holds to single-process
training. Replicas are compared bit for bit.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync.collectives.sharded as sharded_collectives
from gradsync import DistributedDataParallel as DDP
from gradsync.collectives import segmented
from gradsync.collectives.segmented import Exchange
from gradsync.zero import ShardedOptimizer

from harness import run_distributed
from models import UnusedBranch, global_batch, loss_fn, make_model, rank_world, shard
from zero_support import identical_across_ranks, max_relative_difference, sharded_and_reference, train, two_groups


def _parity(name: str, stage: int, optimizer: type, kwargs: dict, micro: int = 1, caps: float | None = None) -> dict:
    ddp, sharded, reference, plain = sharded_and_reference(name, stage, optimizer, kwargs, caps)
    train(ddp, sharded, name, 5, micro)
    train(reference, plain, name, 5, micro)
    return {
        "difference": max_relative_difference(ddp.module, reference.module),
        "identical": identical_across_ranks(ddp.module),
        "rebuilt": ddp.engine.rebuilt,
        "buckets": len(ddp.engine.buckets.storages),
        "params": [p.detach().clone() for p in ddp.module.parameters()],
    }


ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.05})
SGD = (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3})


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_adamw_matches_ddp_with_torch_adamw(stage: int, world: int) -> None:
    """Several buckets (rebuilt after iteration 1: the optimizer state follows), two param groups, an
    LR scheduler; at 3 ranks every bucket is padded."""
    results = run_distributed(_parity, world, "mlp", stage, *ADAMW, 1, 0.001)
    for rank, result in enumerate(results):
        assert result["rebuilt"] and result["buckets"] > 2, result
        assert result["identical"], f"replicas differ on rank {rank}"
        assert result["difference"] <= 1e-6, f"rank {rank}: {result['difference']:.3g} from DDP + torch AdamW"


def test_sharded_sgd_is_bitwise_independent_of_the_bucket_caps() -> None:
    small = run_distributed(_parity, 3, "mlp", 2, *SGD, 1, 0.001)[0]
    large = run_distributed(_parity, 3, "mlp", 2, *SGD, 1)[0]
    assert small["buckets"] > large["buckets"] == 1
    assert all(torch.equal(p, q) for p, q in zip(small["params"], large["params"]))
    assert small["difference"] <= 1e-6 and large["difference"] <= 1e-6


def _parity_in_segments(segment_bytes: int, *args: object) -> dict:
    default = segmented.SEGMENT_BYTES
    segmented.SEGMENT_BYTES = segment_bytes
    try:
        return _parity(*args)
    finally:
        segmented.SEGMENT_BYTES = default


@pytest.mark.parametrize("world", [2, 3])
def test_the_segments_change_no_bit(world: int) -> None:
    """gloo's exchanges in 64-byte segments (every bucket in many of them, summed as they arrive) give
    bitwise the parameters of one segment per bucket, both stages, and DDP + torch AdamW's within 1e-6."""
    for stage in (1, 2):
        tiny = run_distributed(_parity_in_segments, world, 64, "mlp", stage, *ADAMW, 1, 0.001)
        whole = run_distributed(_parity_in_segments, world, 1 << 30, "mlp", stage, *ADAMW, 1, 0.001)
        for a, b in zip(tiny, whole):
            assert a["identical"] and a["difference"] <= 1e-6, a["difference"]
            assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])), f"stage {stage}"


@pytest.mark.parametrize("micro", [1, 2, 3, 7])
def test_gradient_accumulation_under_no_sync(micro: int) -> None:
    for result in run_distributed(_parity, 2, "mlp", 2, *ADAMW, micro, 0.001):
        assert result["identical"] and result["difference"] <= 1e-6, result["difference"]


def _unused(stage: int, in_backward: bool = False) -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    model, reference_model = UnusedBranch(), None
    reference_model = copy.deepcopy(model)
    before = copy.deepcopy(model)
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.001)
    reference = DDP(reference_model, find_unused_parameters=True, bucket_cap_mb=0.001)
    sharded = ShardedOptimizer(
        ddp, torch.optim.AdamW, stage=stage, step_in_backward=in_backward, lr=1e-2, weight_decay=0.1
    )
    plain = torch.optim.AdamW(reference_model.parameters(), lr=1e-2, weight_decay=0.1)
    for wrapper, optimizer in ((ddp, sharded), (reference, plain)):
        for step in range(4):
            x, y = global_batch("mlp", world, step)
            optimizer.zero_grad()
            # "sometimes" is used on rank 0 only, in odd steps: locally unused, globally used
            loss_fn(
                wrapper(shard(x, rank, world), use_sometimes=step % 2 == 1 and rank == 0), shard(y, rank, world)
            ).backward()
            optimizer.step()
    return {
        "unused_untouched": all(
            torch.equal(p, q) for p, q in zip(model.unused.parameters(), before.unused.parameters())
        ),
        "sometimes_moved": not torch.equal(model.sometimes.weight, before.sometimes.weight),
        "difference": max_relative_difference(model, reference_model),
        "same_as_ddp_where_unused": all(
            torch.equal(p, q) for p, q in zip(model.unused.parameters(), reference_model.unused.parameters())
        ),
        "identical": identical_across_ranks(model),
    }


@pytest.mark.parametrize("stage,in_backward", [(1, False), (2, False), (2, True)])
def test_parameters_without_gradient_are_not_stepped(stage: int, in_backward: bool) -> None:
    """in_backward: step_in_backward=True, which steps at the end of backward once the used map is agreed."""
    for result in run_distributed(_unused, 2, stage, in_backward):
        assert result["unused_untouched"] and result["same_as_ddp_where_unused"], result
        assert result["sometimes_moved"] and result["identical"], result
        assert result["difference"] <= 1e-6, result


class Permuted(nn.Module):
    """The forward runs its two branches in an order that changes every step."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, flip: bool = False) -> torch.Tensor:
        first, second = (self.b, self.a) if flip else (self.a, self.b)
        return self.head(torch.tanh(second(torch.tanh(first(x)))))


def _permuted() -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    model = Permuted()
    reference_model = copy.deepcopy(model)
    ddp, reference = DDP(model, bucket_cap_mb=0.0005), DDP(reference_model, bucket_cap_mb=0.0005)
    sharded = ShardedOptimizer(ddp, torch.optim.Adam, lr=1e-2, overlap_param_gather=True)
    plain = torch.optim.Adam(reference_model.parameters(), lr=1e-2)
    for wrapper, optimizer in ((ddp, sharded), (reference, plain)):
        for step in range(6):
            x, y = global_batch("mlp", world, step)
            optimizer.zero_grad()
            loss_fn(wrapper(shard(x, rank, world), flip=step % 2 == 1), shard(y, rank, world)).backward()
            optimizer.step()
    sharded.wait_for_params()  # read outside a forward: the last step's gathers may still be on the wire
    return {"difference": max_relative_difference(model, reference_model), "identical": identical_across_ranks(model)}


def test_a_forward_order_that_changes_still_waits_for_each_bucket() -> None:
    """With the all-gathers overlapping the next forward, each module waits for its own buckets."""
    for result in run_distributed(_permuted, 2):
        assert result["identical"] and result["difference"] <= 1e-6, result


def _grad_after_backward(stage: int) -> dict:
    ddp, sharded, reference, plain = sharded_and_reference("mlp", stage, *ADAMW, 0.001)
    rank, world = rank_world()
    x, y = global_batch("mlp", world, 0)
    for wrapper in (ddp, reference):
        loss_fn(wrapper(shard(x, rank, world)), shard(y, rank, world)).backward()
    grads = [p.grad for p in ddp.module.parameters()]
    expected = [p.grad for p in reference.module.parameters()]
    return {
        "none": all(g is None for g in grads),
        "equal": all(g is not None and torch.equal(g, e) for g, e in zip(grads, expected)),
    }


def test_what_grad_holds_after_backward() -> None:
    """stage 2 keeps no full gradient; stage 1 holds DDP's average (bitwise at two ranks)."""
    assert all(r["none"] for r in run_distributed(_grad_after_backward, 2, 2))
    assert all(r["equal"] for r in run_distributed(_grad_after_backward, 2, 1))


def _gradient_held(stage: int) -> dict:
    """How much full gradient a rank holds while backward runs and after it (bucket buffers and .grad)."""
    ddp, sharded, _, _ = sharded_and_reference("mlp", stage, *ADAMW, 0.0005)
    rank, world = rank_world()
    storages = lambda: ddp.engine.buckets.storages  # noqa: E731 - rebuilt after the first iteration
    peak = {"buckets": 0, "grads": 0}

    def bucket_bytes() -> int:  # distinct storages behind the buckets' flat buffers
        distinct = {s.flat.untyped_storage().data_ptr(): s.flat.untyped_storage().nbytes() for s in storages()}
        return sum(distinct.values())

    def note(_: torch.Tensor) -> None:
        allocated = bucket_bytes()
        grads = sum(p.grad is not None for p in ddp.module.parameters())
        # Drained reduce-scatters hold neither buffers nor their work handle (which holds the buffers).
        in_flight = {id(pending) for _, pending, _ in ddp.engine.reduction._in_flight}
        drained = [p for p in ddp.engine.current.launched if p is not None and id(p) not in in_flight]
        held = sum(
            p.sent.numel() + p.shard.numel() + (p.received is not None) + isinstance(p.work, (dist.Work, Exchange))
            for p in drained
        )
        peak["buckets"], peak["grads"] = max(peak["buckets"], allocated), max(peak["grads"], grads)
        peak["held_by_drained"] = max(peak.get("held_by_drained", 0), held)

    for param in ddp.module.parameters():
        param.register_post_accumulate_grad_hook(note)  # after the reducer's own: the bucket may have launched
    for step in range(3):
        x, y = global_batch("mlp", world, step)
        sharded.zero_grad()
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        after = bucket_bytes()
        sharded.step()
    views = all(
        p.grad is not None
        and any(p.grad.untyped_storage().data_ptr() == s.flat.untyped_storage().data_ptr() for s in storages())
        for p in ddp.module.parameters()
    )
    largest = max(s.flat.numel() * s.flat.element_size() for s in storages())
    return {"buckets": len(storages()), "largest": largest, "peak": peak, "after": after, "grad_views": views}


def test_stage_2_holds_a_bucket_only_while_it_is_sent() -> None:
    """Stage 2: every bucket lives in one shared buffer of the largest bucket's size, at any point of
    backward and after it; stage 1: its .grad are views of the buckets (no second copy of the gradient)."""
    for result in run_distributed(_gradient_held, 2, 2):
        assert result["buckets"] >= 4, result
        assert result["peak"]["buckets"] <= result["largest"] and result["after"] <= result["largest"], result
        assert result["peak"]["held_by_drained"] == 0, result
    for result in run_distributed(_gradient_held, 2, 1):
        assert result["grad_views"], result


def _clip(stage: int, norm_type: float) -> dict:
    ddp, sharded, reference, plain = sharded_and_reference("mlp", stage, *SGD, 0.001)
    rank, world = rank_world()
    norms = []
    for step in range(3):
        x, y = global_batch("mlp", world, step)
        for wrapper, optimizer in ((ddp, sharded), (reference, plain)):
            optimizer.zero_grad()
            loss_fn(wrapper(shard(x, rank, world)) * 10, shard(y, rank, world)).backward()
        ours = sharded.clip_grad_norm_(0.5, norm_type)
        theirs = torch.nn.utils.clip_grad_norm_(reference.module.parameters(), 0.5, norm_type)
        norms.append((ours.item(), theirs.item()))
        sharded.step()
        plain.step()
    return {"norms": norms, "difference": max_relative_difference(ddp.module, reference.module)}


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("stage", [1, 2])
def test_clip_grad_norm_equals_torch_s_under_ddp(stage: int, norm_type: float) -> None:
    for result in run_distributed(_clip, 2, stage, norm_type):
        for ours, theirs in result["norms"]:
            assert ours == pytest.approx(theirs, rel=1e-5), result["norms"]
            assert theirs > 0.5  # the gradients were really clipped
        assert result["difference"] <= 1e-5, result["difference"]


def _checkpoint(stage: int) -> dict:
    ddp, sharded, reference, plain = sharded_and_reference("mlp", stage, *ADAMW, 0.001)
    train(ddp, sharded, "mlp", 3)
    train(reference, plain, "mlp", 3)
    ours, theirs = sharded.state_dict(), plain.state_dict()
    same_format = ours["param_groups"] == theirs["param_groups"] and ours["state"].keys() == theirs["state"].keys()
    close = all(
        torch.allclose(ours["state"][i][k], theirs["state"][i][k], rtol=1e-5, atol=1e-8)
        for i in theirs["state"]
        for k in theirs["state"][i]
    )
    # An unwrapped optimizer of the same class loads it, in this process alone.
    alone = copy.deepcopy(ddp.module)
    loaded = torch.optim.AdamW(two_groups(alone, ADAMW[1]["lr"]), **ADAMW[1])
    loaded.load_state_dict(ours)
    # And the sharded optimizer loads the unsharded one's state, then trains on like it.
    sharded.load_state_dict(theirs)
    with torch.no_grad():
        for p, q in zip(ddp.module.parameters(), reference.module.parameters()):
            p.copy_(q)
    train(ddp, sharded, "mlp", 2)
    train(reference, plain, "mlp", 2)
    return {
        "same_format": same_format,
        "close": close,
        "loaded_steps": [s["step"].item() for s in loaded.state_dict()["state"].values()],
        "difference": max_relative_difference(ddp.module, reference.module),
        "model_state_bytes": _saved_bytes(ddp.state_dict()) == _saved_bytes(reference.state_dict()),
    }


def _saved_bytes(state: dict) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("stage", [1, 2])
def test_state_dict_is_torch_s_plain_format_both_ways(stage: int) -> None:
    for result in run_distributed(_checkpoint, 2, stage):
        assert result["same_format"] and result["close"], result
        assert set(result["loaded_steps"]) == {3.0}
        assert result["difference"] <= 1e-6, result["difference"]
        assert result["model_state_bytes"], "ddp.state_dict() must serialise to the same bytes as plain DDP's"


def _state_dict_on_rank_0_only() -> str:
    rank, world = rank_world()
    torch.manual_seed(0)
    ddp = DDP(make_model("mlp"))
    optimizer = ShardedOptimizer(ddp, torch.optim.SGD, lr=0.1, state_dict_timeout_s=3)
    train(ddp, optimizer, "mlp", 1)
    if rank == 0:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="state_dict\\(\\) is collective: every rank must call it") as error:
            optimizer.state_dict()
        assert time.monotonic() - started < 30
        message = str(error.value)
    else:
        time.sleep(6)
        message = ""
    dist.barrier()
    return message


def test_state_dict_on_one_rank_raises_instead_of_hanging() -> None:
    messages = run_distributed(_state_dict_on_rank_0_only, 2)
    assert "Call it on every rank and save from rank 0" in messages[0]


def _bytes_per_step(sharded: bool) -> dict[str, int]:
    """Elements each collective kind moves in one steady-state step (recorded, no timing)."""
    rank, world = rank_world()
    torch.manual_seed(0)
    model = make_model("wide")
    ddp = DDP(model, bucket_cap_mb=0.1)
    optimizer = (
        ShardedOptimizer(ddp, torch.optim.SGD, lr=0.01) if sharded else torch.optim.SGD(model.parameters(), lr=0.01)
    )
    train(ddp, optimizer, "mlp", 2)  # past the rebuild
    settle = getattr(optimizer, "wait_for_params", lambda: None)  # the gathers overlap the next forward
    settle()
    moved: dict[str, int] = {}
    names = ("all_reduce", "all_to_all_single", "broadcast", "isend", "irecv")
    originals = {name: getattr(dist, name) for name in names}
    gather = sharded_collectives._all_gather

    def record(name: str, original, counts):  # noqa: ANN001
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003
            moved[name] = moved.get(name, 0) + counts(*args)  # sends run on the exchange's thread: one adds at a time
            return original(*args, **kwargs)

        return wrapper

    per_rank_send = (world - 1) / world
    dist.all_reduce = record("all_reduce", originals["all_reduce"], lambda t, *a: int(2 * per_rank_send * t.numel()))
    dist.all_to_all_single = record(
        "all_to_all", originals["all_to_all_single"], lambda o, i, *a: int(per_rank_send * i.numel())
    )
    dist.broadcast = record("broadcast", originals["broadcast"], lambda t, *a: t.numel())
    dist.isend = record("send", originals["isend"], lambda t, *a: t.numel())
    dist.irecv = record("receive", originals["irecv"], lambda t, *a: t.numel())
    # The segments go through the process group's own point-to-point calls: counted there (once each).
    # (Restored from the class's own dict: the attribute read back is an unbound builtin, which a class
    # attribute does not bind to its instance.)
    group_calls = {"send": vars(dist.ProcessGroup)["send"], "recv": vars(dist.ProcessGroup)["recv"]}
    dist.ProcessGroup.send = record("send", dist.ProcessGroup.send, lambda group, tensors, *a: tensors[0].numel())
    dist.ProcessGroup.recv = record("receive", dist.ProcessGroup.recv, lambda group, tensors, *a: tensors[0].numel())
    sharded_collectives._all_gather = record("all_gather", gather, lambda o, i, *a: int(per_rank_send * o.numel()))
    try:
        train(ddp, optimizer, "mlp", 1)
        settle()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        dist.ProcessGroup.send, dist.ProcessGroup.recv = group_calls["send"], group_calls["recv"]
        sharded_collectives._all_gather = gather
    return moved


def test_a_sharded_step_moves_what_one_all_reduce_moves() -> None:
    ddp = run_distributed(_bytes_per_step, 2, False)[0]
    zero = run_distributed(_bytes_per_step, 2, True)[0]
    # On gloo the reduce-scatter and the all-gather are point-to-point segments ([Note: exchanges in segments]).
    assert set(ddp) == {"all_reduce"} and set(zero) == {"send", "receive"}, (ddp, zero)
    assert zero["send"] == zero["receive"]
    assert 0.95 * ddp["all_reduce"] <= zero["send"] <= 1.05 * ddp["all_reduce"], (zero, ddp)


def _misuse() -> list[str]:
    torch.manual_seed(0)
    messages = []
    cases = [
        lambda: ShardedOptimizer(DDP(make_model("mlp")), torch.optim.LBFGS, lr=1),
        lambda: ShardedOptimizer(DDP(make_model("mlp")), torch.optim.SGD, [nn.Parameter(torch.ones(2))], lr=1),
        lambda: ShardedOptimizer(DDP(make_model("mlp")), torch.optim.SGD, stage=3, lr=1),
    ]
    for case in cases:
        with pytest.raises((ValueError, TypeError)) as error:
            case()
        messages.append(str(error.value))
    ddp = DDP(make_model("mlp"))
    optimizer = ShardedOptimizer(ddp, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="cannot be applied to a sharded optimizer's reduce-scatter"):
        ddp.register_comm_hook(None, lambda state, bucket: None)
    with pytest.raises(NotImplementedError, match="_register_fused_optim cannot be combined with a sharded optimizer"):
        ddp._register_fused_optim(torch.optim.SGD, 0.1)
    with pytest.raises(RuntimeError, match="already has a ShardedOptimizer"):
        ShardedOptimizer(ddp, torch.optim.SGD, lr=0.1)
    train(ddp, optimizer, "mlp", 1)
    with pytest.raises(RuntimeError, match="must be built before the first forward"):
        ShardedOptimizer(ddp, torch.optim.SGD, lr=0.1)
    return messages


def test_misuse_is_named() -> None:
    lbfgs, outside, stage = run_distributed(_misuse, 2)[0]
    assert "LBFGS is not known to update each element from that element alone" in lbfgs
    assert "can only step parameters its DistributedDataParallel reduces" in outside
    assert "stage must be 1" in stage


def _state_size_and_copies(stage: int, static_graph: bool) -> dict:
    """The optimizer state is this rank's shard only; a deepcopy of the model (an EMA) works."""
    rank, world = rank_world()
    torch.manual_seed(0)
    model = make_model("mlp")
    reference_model = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.001, static_graph=static_graph)
    reference = DDP(reference_model, bucket_cap_mb=0.001, static_graph=static_graph)
    sharded = ShardedOptimizer(ddp, torch.optim.Adam, stage=stage, lr=1e-2, overlap_param_gather=True)
    plain = torch.optim.Adam(reference_model.parameters(), lr=1e-2)
    train(ddp, sharded, "mlp", 3)
    train(reference, plain, "mlp", 3)
    sharded.wait_for_params()  # overlap_param_gather: a read outside a forward waits for the last step's gathers
    ema = copy.deepcopy(ddp.module)
    x, _ = global_batch("mlp", world, 99)
    state_numel = sum(v.numel() for s in sharded._inner.state.values() for v in s.values() if v.dim() > 0)
    counts = torch.tensor([state_numel])
    every = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(every, counts)
    return {
        "state_numel": [int(c) for c in every],
        "params_numel": sum(p.numel() for p in model.parameters()),
        "ema_matches": torch.equal(ema(x), ddp.module(x)),
        "difference": max_relative_difference(model, reference_model),
    }


@pytest.mark.parametrize("stage,static_graph", [(1, False), (2, False), (2, True)])
def test_optimizer_state_is_sharded_and_models_deepcopy(stage: int, static_graph: bool) -> None:
    for result in run_distributed(_state_size_and_copies, 2, stage, static_graph):
        # Adam keeps exp_avg and exp_avg_sq per element: twice the parameters over all ranks together.
        assert sum(result["state_numel"]) == 2 * result["params_numel"], result
        assert max(result["state_numel"]) <= 2 * result["params_numel"] // 2 + 2 * 64, result
        assert result["ema_matches"] and result["difference"] <= 1e-6, result
