"""Initial sync, buffer sync, state_dict, input placement."""

from __future__ import annotations

import collections
import copy
import dataclasses
import io
import pickle

import pytest
import torch

from gradsync import DistributedDataParallel as DDP
from gradsync.wrapper.device import move_to_device

from harness import run_distributed
from models import MLP, ConvBN, all_gather_flat, global_batch, loss_fn, rank_world, shard


def _init_sync(init_sync: bool) -> bool:
    rank, _ = rank_world()
    torch.manual_seed(rank)  # every rank starts from different weights
    model = ConvBN()
    DDP(model, init_sync=init_sync)
    params = all_gather_flat(list(model.parameters()))
    buffers = all_gather_flat([b.float() for b in model.buffers() if b.is_floating_point()])
    return all(torch.equal(params[0], p) for p in params) and all(torch.equal(buffers[0], b) for b in buffers)


def test_init_sync_broadcasts_rank0_state() -> None:
    assert run_distributed(_init_sync, 3, True) == [True] * 3


def test_init_sync_false_leaves_replicas_alone() -> None:
    assert run_distributed(_init_sync, 2, False) == [False] * 2


def _buffer_sync(mode: str) -> tuple[bool, bool]:
    """Returns (buffers equal across ranks after wrapping, after the next forward)."""
    rank, world = rank_world()
    torch.manual_seed(0)
    model = ConvBN()
    model.bn1.running_mean.fill_(float(rank))  # rank-dependent buffer before wrapping
    kwargs = {
        "default": {},
        "forward_sync_off": {"forward_sync_buffers": False},
        "broadcast_buffers_off": {"broadcast_buffers": False},
    }[mode]
    ddp = DDP(model, **kwargs)
    after_wrap = all_gather_flat([model.bn1.running_mean])
    x, y = global_batch("cnn_bn", world, 0)
    loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    # training forwards update running stats from local data, so ranks differ here;
    # rank 0's values are what every rank must hold after the next forward's sync
    expected = all_gather_flat([model.bn1.running_mean])[0]
    ddp.eval()
    with torch.no_grad():
        ddp(shard(x, rank, world))
    after_next = all_gather_flat([model.bn1.running_mean])
    wrap_equal = all(torch.equal(after_wrap[0], t) for t in after_wrap)
    next_equal = all(torch.equal(expected, t) for t in after_next)
    return wrap_equal, next_equal


def test_buffers_broadcast_before_forward_by_default() -> None:
    assert run_distributed(_buffer_sync, 2, "default") == [(True, True)] * 2


def test_forward_sync_buffers_false_keeps_init_sync_only() -> None:
    assert run_distributed(_buffer_sync, 2, "forward_sync_off") == [(True, False)] * 2


def test_broadcast_buffers_false_skips_init_and_forward_sync() -> None:
    # rank 1's result differs: its own buffers are not rank 0's, before or after
    results = run_distributed(_buffer_sync, 2, "broadcast_buffers_off")
    assert results == [(False, False)] * 2


class _MixedBuffers(torch.nn.Module):
    """Buffers of many dtypes and layouts, filled from a seed; forward leaves them alone."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("f32", torch.randn(5, generator=g))
        self.register_buffer("count", torch.randint(0, 1 << 40, (), generator=g))  # 0-dim int64
        self.register_buffer("mask", torch.rand(7, generator=g) > 0.5)
        self.register_buffer("f64", torch.randn(2, 3, generator=g, dtype=torch.float64))
        self.register_buffer("f16", torch.randn(3, generator=g).half())
        self.register_buffer("transposed", torch.randn(4, 3, generator=g).t())  # not contiguous
        self.register_buffer("empty", torch.empty(0, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _mixed_buffer_sync() -> tuple[bool, bool]:
    """(buffers are rank 0's after wrapping, and again after a forward once ranks diverged)."""
    rank, _ = rank_world()
    model = _MixedBuffers(seed=rank)
    ddp = DDP(model)
    expected = dict(_MixedBuffers(seed=0).named_buffers())  # rank 0's, rebuilt independently
    after_wrap = all(torch.equal(b, expected[n]) and b.dtype == expected[n].dtype for n, b in model.named_buffers())
    for name, buffer in model.named_buffers():  # every rank drifts differently
        buffer.copy_(_MixedBuffers(seed=10 + rank).get_buffer(name))
    expected = dict(_MixedBuffers(seed=10).named_buffers())
    ddp(torch.randn(2, 3))
    after_forward = all(torch.equal(b, expected[n]) for n, b in model.named_buffers())
    return after_wrap, after_forward and not model.transposed.is_contiguous()


def test_buffers_of_every_dtype_broadcast_bitwise() -> None:
    # float, int64, bool, float64, half, a transposed and an empty buffer share one byte buffer
    assert run_distributed(_mixed_buffer_sync, 3) == [(True, True)] * 3


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += 1
        return func(*args, **(kwargs or {}))


def _buffers_over_many_forwards() -> tuple[list[bool], int, int]:
    """(after each forward: every buffer is rank 0's; operators dispatched by the second and the fifth
    forward, whose module runs one Linear: the buffer broadcast's own operators)."""
    rank, _ = rank_world()
    model = _MixedBuffers(seed=rank)
    ddp = DDP(model)
    synced, counts = [], []
    for step in range(6):
        for name, buffer in model.named_buffers():  # every rank drifts differently, every step
            buffer.copy_(_MixedBuffers(seed=100 * step + rank).get_buffer(name))
        if step == 5:  # a buffer changes its shape (the same tensor object): the broadcast follows
            model.f32.data = torch.randn(9, generator=torch.Generator().manual_seed(rank))
        expected = {n: b.clone() for n, b in _MixedBuffers(seed=100 * step).named_buffers()}
        if step == 5:
            expected["f32"] = torch.randn(9, generator=torch.Generator().manual_seed(0))
        counter = _CountOps()
        with counter:
            ddp(torch.randn(2, 3))
        counts.append(counter.count)
        synced.append(all(torch.equal(b, expected[n]) for n, b in model.named_buffers()))
    return synced, counts[1], counts[4]


def _copies_sync_their_own_buffers() -> list[bool]:
    """A wrapper copied after its layout was kept (pickle, deepcopy) broadcasts the copy's buffers,
    and leaves the original's alone."""
    rank, world = rank_world()
    torch.manual_seed(0)
    ddp = DDP(ConvBN())
    x, _ = global_batch("cnn_bn", world, 0)
    ddp(shard(x, rank, world))  # the layout is kept from here
    original = ddp.module.bn1.running_mean.clone()
    results = []
    for copied in (pickle.loads(pickle.dumps(ddp)), copy.deepcopy(ddp)):
        copied.module.bn1.running_mean.fill_(10.0 + rank)
        copied.eval()  # an eval forward leaves the running statistics as broadcast
        with torch.no_grad():
            copied(shard(x, rank, world))
        results.append(torch.equal(copied.module.bn1.running_mean, torch.full_like(original, 10.0)))
        results.append(torch.equal(ddp.module.bn1.running_mean, original))
    return results


def test_copied_wrappers_broadcast_their_own_buffers() -> None:
    assert run_distributed(_copies_sync_their_own_buffers, 2) == [[True] * 4] * 2


def test_buffers_broadcast_before_every_forward_through_a_kept_layout() -> None:
    # The flat layout is made once ([Note: a broadcast that keeps its flat buffers]): a forward's
    # operators do not grow with the number of buffers (7 here; laid out per call: 3 views each).
    for synced, second, later in run_distributed(_buffers_over_many_forwards, 2):
        assert synced == [True] * 6
        assert second <= 12 and later <= 12, (second, later)


def _state_dict_round_trip() -> None:
    rank, world = rank_world()
    torch.manual_seed(0)
    ours = DDP(MLP())
    theirs = torch.nn.parallel.DistributedDataParallel(MLP())
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert all(key.startswith("module.") for key in ours.state_dict())
    x, y = global_batch("mlp", world, 0)
    opt = torch.optim.SGD(ours.parameters(), lr=0.5)
    loss_fn(ours(shard(x, rank, world)), shard(y, rank, world)).backward()
    opt.step()
    buffer = io.BytesIO()
    torch.save(ours.state_dict(), buffer)
    buffer.seek(0)
    theirs.load_state_dict(torch.load(buffer))
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)
    again = DDP(MLP())
    again.load_state_dict(theirs.state_dict())
    for p, q in zip(again.parameters(), ours.parameters()):
        assert torch.equal(p, q)


def test_state_dict_interchangeable_with_torch_ddp() -> None:
    run_distributed(_state_dict_round_trip, 2)


Pair = collections.namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass
class Batch:
    features: torch.Tensor
    extras: dict
    label: str = "x"


def test_move_to_device_walks_every_container() -> None:
    meta = torch.device("meta")
    batch = (
        torch.ones(2),
        [torch.ones(3), {"k": Pair(torch.ones(1), 5)}],
        Batch(torch.ones(4), {"m": torch.zeros(2)}),
    )
    moved = move_to_device(batch, meta)
    assert moved[0].device == meta
    assert moved[1][0].device == meta
    assert isinstance(moved[1][1]["k"], Pair) and moved[1][1]["k"].left.device == meta
    assert moved[1][1]["k"].right == 5
    assert isinstance(moved[2], Batch) and moved[2].features.device == meta
    assert moved[2].extras["m"].device == meta and moved[2].label == "x"
    assert batch[0].device.type == "cpu"  # the original is left alone


def _train_eval_pass_through() -> None:
    ddp = DDP(ConvBN())
    assert ddp.eval() is ddp and not ddp.module.training and not ddp.module.bn1.training
    assert ddp.train() is ddp and ddp.module.training
    assert ddp.module.bn1.training


def test_train_and_eval_pass_through() -> None:
    run_distributed(_train_eval_pass_through, 2)


@pytest.mark.parametrize("as_view", [True])
def test_bucket_view_grads_survive_set_to_none(as_view: bool) -> None:
    run_distributed(_bucket_views, 2)


def _bucket_views() -> None:
    rank, world = rank_world()
    model = MLP()
    ddp = DDP(model, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = global_batch("mlp", world, step)
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        for p in model.parameters():
            assert p.grad._base is not None, "after backward every .grad is a view into a flat bucket"
        opt.step()
