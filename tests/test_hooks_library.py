"""gradsync.hooks: each hook against a hand reference, its wire bytes, and convergence.

Three tiers: the pure helpers in one process; each hook called directly on a hand-built
``GradBucket`` on 2 ranks, against references computed from every rank's gradient;
the hooks under DDP (replicas bitwise identical, lossless settings equal plain
all-reduce, measured compression ratios) and a small convergence test.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel as DDP
from gradsync.engine.grad_bucket import GradBucket
from gradsync.engine.storage import BucketStorage
from gradsync.hooks import (
    AllReduceState,
    BucketMemory,
    Int8State,
    PowerSGDState,
    TopKState,
    WireStats,
    allreduce_hook,
    batched_powersgd_hook,
    bf16_compress_hook,
    compress_wrapper,
    fp16_compress_hook,
    int8_hook,
    low_rank,
    powersgd_hook,
    topk_hook,
)
from gradsync.hooks.denormals import flushed_denormals, flushing_denormals
from gradsync.hooks.low_rank import orthonormalise
from gradsync.hooks.matrix_groups import matrix_shape
from gradsync.hooks.powersgd import _square_ish
from gradsync.hooks.topk import largest_indices
from gradsync.hooks.wire import all_gather_bytes, all_reduce_bytes

from harness import run_distributed
from models import all_gather_flat, global_batch, grads_of, loss_fn, make_model, shard

W = 2  # world size of every distributed test here


# ---------------------------------------------------------------------------- tier 1: helpers
def test_wire_bytes_follow_the_ring_model() -> None:
    assert all_reduce_bytes(torch.zeros(10), 2) == 40  # 2 (W-1)/W * 40 bytes
    assert all_reduce_bytes(torch.zeros(10), 4) == 60
    assert all_gather_bytes(torch.zeros(10, dtype=torch.int8), 4) == 30  # (W-1) * 10 bytes
    stats = WireStats(2)
    stats.add(5)
    stats.end_iteration()
    stats.add_all_reduce(torch.zeros(3))
    stats.end_iteration()
    assert stats.bytes_per_iteration == [5, 12] and stats.mean_bytes_per_iteration(last=1) == 12


def test_bad_knobs_are_rejected_with_the_fix() -> None:
    with pytest.raises(ValueError, match="start_iter=2"):
        PowerSGDState(None, start_iter=1)
    with pytest.raises(ValueError, match="matrix_approximation_rank"):
        PowerSGDState(None, matrix_approximation_rank=0)
    with pytest.raises(ValueError, match="ratio"):
        TopKState(None, ratio=0.0)
    with pytest.raises(ValueError, match="floating dtype"):
        compress_wrapper(allreduce_hook, torch.int8)
    bucket = GradBucket(0, torch.zeros(2), BucketStorage([0], [torch.zeros(2)], False), is_last=True)
    with pytest.raises(TypeError, match="AllReduceState"):
        allreduce_hook("WORLD", bucket)


def test_matrix_views_and_padding() -> None:
    assert _square_ish(64) == (8, 8) and _square_ish(60) == (8, 8) and _square_ish(65) == (9, 8)
    assert matrix_shape(torch.zeros(4, 3, 2, 2)) == (4, 12)
    assert matrix_shape(torch.zeros(4, 3, 2, 2).to(memory_format=torch.channels_last)) == (4, 12)
    assert matrix_shape(torch.zeros(5)) is None and matrix_shape(torch.zeros(1, 5)) is None


def test_orthonormalise_survives_zero_and_half_precision() -> None:
    zero = torch.zeros(6, 2)
    orthonormalise(zero)
    assert torch.isfinite(zero).all()
    p = torch.randn(6, 2, generator=torch.Generator().manual_seed(0))
    orthonormalise(p)
    assert torch.allclose(p.T @ p, torch.eye(2), atol=1e-6)
    half = torch.randn(6, 2, generator=torch.Generator().manual_seed(1)).bfloat16()
    orthonormalise(half)
    assert torch.allclose((half.T @ half).float(), torch.eye(2), atol=2e-2)


DENORMAL = 1e-39  # below fp32's smallest normal number, 1.2e-38


def test_flushed_denormals_restores_the_thread_s_own_setting() -> None:
    """[Note: denormals in a low-rank round]: flushed inside, the thread's setting after, either way."""
    tiny = torch.full((4,), DENORMAL)
    cpu = torch.device("cpu")
    for users_setting in (False, True):
        torch.set_flush_denormal(users_setting)
        try:
            with flushed_denormals(cpu):
                assert flushing_denormals() and torch.equal(tiny * 1.0, torch.zeros(4))
            assert flushing_denormals() is users_setting
            with pytest.raises(ValueError), flushed_denormals(cpu):  # restored on an exception too
                raise ValueError
            assert flushing_denormals() is users_setting
        finally:
            torch.set_flush_denormal(False)
    with flushed_denormals(torch.device("meta")):  # not the CPU: nothing switched
        assert not flushing_denormals() and bool((tiny * 1.0 > 0).all())


def test_bucket_memory_forgets_a_bucket_whose_parameters_changed() -> None:
    params = [torch.zeros(3), torch.zeros(2)]
    before = GradBucket(0, torch.zeros(3), BucketStorage([0], params[:1], False), is_last=True)
    after = GradBucket(0, torch.zeros(2), BucketStorage([1], params[1:], False), is_last=True)
    memory = BucketMemory()
    memory.store(before, torch.ones(3))
    assert memory.lookup(before) is not None and memory.lookup(after) is None


# ---------------------------------------------------------------------------- tier 2: hook math
SHAPES = [(8, 6), (6,), (5, 4, 3), (4,)]  # two matrices PowerSGD compresses, two vectors it does not
NUMEL = sum(math.prod(s) for s in SHAPES)


def _grad(step: int, rank: int, numel: int = NUMEL) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + rank))


def _mean(step: int, numel: int = NUMEL) -> torch.Tensor:
    """What plain all-reduce computes: each rank's gradient divided by W, then summed."""
    return sum(_grad(step, r, numel) / W for r in range(W))


def _magnitude(step: int) -> torch.Tensor:
    return sum(_grad(step, r).abs() / W for r in range(W))


class Buckets:
    """Hand-built buckets over fixed parameters, so per-bucket memories persist between calls."""

    def __init__(self, shapes: list[tuple[int, ...]] = SHAPES) -> None:
        self.params = [torch.zeros(s) for s in shapes]

    def __call__(self, flat: torch.Tensor, index: int = 0, is_last: bool = True) -> GradBucket:
        storage = BucketStorage(list(range(len(self.params))), self.params, False)
        storage.flat.copy_(flat)
        return GradBucket(index, storage.flat, storage, is_last=is_last)


def _run(hook: Callable[..., Any], state: Any, bucket: GradBucket) -> torch.Tensor:
    result = hook(state, bucket).wait()
    return (result[0] if isinstance(result, list) else result).clone()


def _everyone(tensor: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(W)]
    dist.all_gather(gathered, tensor.contiguous())
    return gathered


def _check_plain_and_casts() -> None:
    rank = dist.get_rank()
    make = Buckets()
    mean, magnitude = _mean(0), _magnitude(0)
    for state in (None, dist.group.WORLD, AllReduceState()):
        assert torch.equal(_run(allreduce_hook, state, make(_grad(0, rank))), mean)
    for hook, dtype in ((fp16_compress_hook, torch.float16), (bf16_compress_hook, torch.bfloat16)):
        state = AllReduceState()
        result = _run(hook, state, make(_grad(0, rank)))
        assert result.dtype == torch.float32
        # Cast of each (g / W), then a sum in dtype: at most two roundings of dtype's precision.
        bound = torch.finfo(dtype).eps * magnitude + 2**-24
        assert ((result - mean).abs() <= bound).all(), f"{dtype}: {(result - mean).abs().max()}"
        assert state.wire.bytes_per_iteration == [NUMEL * 2]  # half of the fp32 all-reduce's 4 * NUMEL
    wrapped = _run(compress_wrapper(allreduce_hook, torch.float16), None, make(_grad(0, rank)))
    direct = _run(fp16_compress_hook, None, make(_grad(0, rank)))
    # Same bits except where the wrapper's divide-after-cast double-rounds an fp16 subnormal.
    assert (wrapped - direct).abs().max() <= 2**-24


def test_plain_and_cast_hooks_match_hand_reference() -> None:
    run_distributed(_check_plain_and_casts, W)


def _rank_one_grads(step: int, rank: int, rows: int, cols: int) -> torch.Tensor:
    """Every rank's gradient is u v_r^T with a shared u, so their average has rank one."""
    u = torch.randn(rows, generator=torch.Generator().manual_seed(step))
    return torch.outer(u, _grad(step, rank, cols)).reshape(-1)


def _assert_powersgd_of_mean(result: torch.Tensor, step: int) -> None:
    """Vectors exactly the mean; each matrix a rank-one projection of the mean."""
    mean, offset = _mean(step), 0
    for shape in SHAPES:
        n = math.prod(shape)
        got, want = result[offset : offset + n], mean[offset : offset + n]
        if len(shape) == 1:
            assert torch.equal(got, want)
        else:
            _assert_rank_r_projection(got.view(shape[0], -1), want.view(shape[0], -1), 1)
        offset += n


def _full_rank_state() -> PowerSGDState:
    """PowerSGD at a rank above every matrix's, compressing from the first step, no memory: lossless."""
    return PowerSGDState(
        None,
        matrix_approximation_rank=64,
        start_iter=0,
        min_compression_rate=0,
        use_error_feedback=False,
        warm_start=False,
    )


def _check_powersgd() -> None:
    rank = dist.get_rank()
    make = Buckets()
    # Before start_iter: plain all-reduce, bit for bit.
    state = PowerSGDState(None, start_iter=2)
    for step in range(2):
        assert torch.equal(_run(powersgd_hook, state, make(_grad(step, rank))), _mean(step))
    # Then: vectors exact; each matrix the projection of the average onto r orthonormal columns.
    _assert_powersgd_of_mean(_run(powersgd_hook, state, make(_grad(2, rank))), 2)
    assert state.wire.bytes_per_iteration[-1] == 4 * ((8 + 6) + (5 + 12) + 6 + 4)  # P, Q, vectors
    # Full rank is lossless; a rank-one average is recovered exactly at rank one.
    full = _full_rank_state()
    assert torch.allclose(_run(powersgd_hook, full, make(_grad(3, rank))), _mean(3), atol=1e-5)
    square = Buckets([(8, 8)])
    for hook in (powersgd_hook, batched_powersgd_hook):
        state = PowerSGDState(None, start_iter=0, use_error_feedback=False, warm_start=False)
        got = _run(hook, state, square(_rank_one_grads(4, rank, 8, 8)))
        want = sum(_rank_one_grads(4, r, 8, 8) / W for r in range(W))
        assert torch.allclose(got, want, atol=1e-5), hook.__name__
    # Batched over an unpadded 11 x 11 bucket: the rank-one projection of the average.
    state = PowerSGDState(None, start_iter=0, use_error_feedback=False, warm_start=False)
    got = _run(batched_powersgd_hook, state, Buckets([(11, 11)])(_grad(5, rank, 121)))
    _assert_rank_r_projection(got.view(11, 11), _mean(5, 121).view(11, 11), 1)
    # Padded (118 entries as 11 x 11): result = p q^T, q = M^T p, |p| = 1, M the zero-padded average.
    state = PowerSGDState(None, start_iter=2)
    state.iter = 2
    got = _run(batched_powersgd_hook, state, make(_grad(5, rank)))
    q = state.q_memory.get(0)  # the all-reduced Q, kept for the warm start
    p = got[:110].view(10, 11) @ q / q.dot(q)  # the 10 complete rows give p's first entries
    p = torch.cat([p, got[110:] @ q[:8] / q[:8].dot(q[:8]).reshape(1)])  # the last, 8 of 11 filled
    padded = torch.cat([_mean(5), torch.zeros(3)]).view(11, 11)
    assert torch.allclose(p.norm(), torch.tensor(1.0), atol=1e-5)
    assert torch.allclose(torch.outer(p, q).reshape(-1)[:NUMEL], got, atol=1e-5)
    assert torch.allclose(padded.T @ p, q, atol=1e-5)
    assert state.wire.bytes_per_iteration[-1] == 4 * (11 + 11)


def _assert_rank_r_projection(approx: torch.Tensor, target: torch.Tensor, r: int) -> None:
    """``approx == B B^T target`` for B an orthonormal basis of approx's column space."""
    basis = torch.linalg.svd(approx.double())[0][:, :r]
    projected = (basis @ (basis.T @ target.double())).float()
    assert torch.allclose(projected, approx, atol=1e-5), (projected - approx).abs().max()


def test_powersgd_matches_hand_reference() -> None:
    run_distributed(_check_powersgd, W)


def _check_powersgd_flushes_denormals(users_setting: bool) -> None:
    """[Note: denormals in a low-rank round]: the round computes denormal entries as zero (the rest as
    before), on every rank alike, and leaves the calling thread's own setting as it was."""
    rank = dist.get_rank()
    torch.set_flush_denormal(users_setting)
    try:
        make = Buckets()
        state = PowerSGDState(None, start_iter=2)
        for step in range(2):  # plain all-reduce before start_iter: exact, denormals included
            grad = _grad(step, rank) * DENORMAL
            got = _run(powersgd_hook, state, make(grad))
            if not users_setting:
                assert bool((got != 0).all()) and torch.equal(got, sum(_grad(step, r) * DENORMAL / W for r in range(W)))
        tiny = _grad(2, rank) * DENORMAL  # every entry denormal: vectors and matrices
        got = _run(powersgd_hook, state, make(tiny))
        assert torch.equal(got, torch.zeros_like(got)), "a denormal entry was computed, not flushed"
        assert flushing_denormals() is users_setting, "the hook changed this thread's setting"
        _assert_powersgd_of_mean(_run(powersgd_hook, state, make(_grad(3, rank))), 3)  # normal numbers: as before
        assert all(torch.equal(got, other) for other in _everyone(got))
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.parametrize("users_setting", [False, True], ids=["user_keeps_denormals", "user_flushes"])
def test_powersgd_flushes_denormals(users_setting: bool) -> None:
    run_distributed(_check_powersgd_flushes_denormals, W, users_setting)


# Same-shaped matrices interleaved with vectors: powersgd_hook stacks the three 6 x 4 ones
# ([Note: matrices stacked by shape] in hooks/matrix_groups.py).
STACKED = [(6, 4), (5,), (6, 4), (3,), (7, 3), (6, 4), (2,)]


def _stacked_grad(step: int, rank: int) -> torch.Tensor:
    """Each matrix u_i v_{i,rank}^T with u_i shared by the ranks (their average has rank one); vectors random."""
    pieces = []
    for i, shape in enumerate(STACKED):
        if len(shape) == 1:
            pieces.append(_grad(step * 10 + i, rank, shape[0]))
        else:
            u = torch.randn(shape[0], generator=torch.Generator().manual_seed(1000 * step + i))
            pieces.append(torch.outer(u, _grad(step * 10 + i, rank, shape[1])).reshape(-1))
    return torch.cat(pieces)


def _check_powersgd_stacks_same_shaped_matrices(small: int | None) -> None:
    # [Note: the forms of a stack's products]: the defaults take every form for small matrices, 0 every
    # form for large ones (the transposed residual and output at rank 1); each bucket has a run of two
    # matrices 29 elements apart (a strided output view) and runs of one (contiguous).
    if small is not None:
        low_rank.SMALL_RESIDUAL = low_rank.SMALL_OUTPUT = small
    rank = dist.get_rank()
    make = Buckets(STACKED)
    mean = sum(_stacked_grad(0, r) / W for r in range(W))
    # Rank-one averages are recovered exactly, each matrix at its own place: a matrix written to
    # another's place, or a vector moved, would not match.
    state = PowerSGDState(None, start_iter=0, use_error_feedback=False, warm_start=False)
    got = _run(powersgd_hook, state, make(_stacked_grad(0, rank)))
    assert torch.allclose(got, mean, atol=1e-5), (got - mean).abs().max()
    assert [(g.rows, g.cols, len(g.offsets)) for g in state.layouts[0][1].groups] == [(6, 4, 3), (7, 3, 1)]
    # Full rank loses nothing: P = M Q at rank 3-4 spans each matrix (the forms at rank 2 or more).
    full = _full_rank_state()
    got = _run(powersgd_hook, full, make(_grad(9, rank, mean.numel())))
    assert torch.allclose(got, _mean(9, mean.numel()), atol=1e-5), (got - _mean(9, mean.numel())).abs().max()
    # With error feedback, what was applied plus what is owed is what was computed, step after step.
    state = PowerSGDState(None, start_iter=2)  # error feedback and warm start: from iteration 2
    applied, computed = torch.zeros_like(mean), torch.zeros_like(mean)
    for step in range(1, 7):
        grad = _grad(step, rank, mean.numel())  # full rank: something is held back
        applied += _run(powersgd_hook, state, make(grad))
        computed += _mean(step, mean.numel())
    debt = sum(_everyone(state.residual(0)))
    assert debt.abs().max() > 1e-3, "nothing was held back: the check would prove nothing"
    assert torch.allclose(applied + debt, computed, atol=1e-5), (applied + debt - computed).abs().max()


@pytest.mark.parametrize("small", [None, 0], ids=["small_forms", "large_forms"])
def test_powersgd_stacks_same_shaped_matrices(small: int | None) -> None:
    run_distributed(_check_powersgd_stacks_same_shaped_matrices, W, small)


def _check_powersgd_rounds_across_buckets() -> None:
    """[Note: P in flight]: a bucket's Q step waits for the next bucket's call, or the pass's end."""
    rank = dist.get_rank()
    makers = [Buckets() for _ in range(3)]
    state = PowerSGDState(None, start_iter=0, use_error_feedback=False, warm_start=False)
    futures = []
    for b, make in enumerate(makers):
        futures.append(powersgd_hook(state, make(_grad(10 + b, rank), index=b, is_last=b == 2)))
        if b < 2:
            assert not futures[b].done(), "Q of this bucket cannot have been launched before the next call"
    for b, future in enumerate(futures):
        _assert_powersgd_of_mean(future.wait(), 10 + b)
    assert state.iter == 1
    # The pass ends without its last bucket (skipped as unused): the reducer's finish_launches.
    future = powersgd_hook(state, makers[0](_grad(20, rank), index=0, is_last=False))
    assert not future.done()
    state.finish_launches()
    _assert_powersgd_of_mean(future.wait(), 20)
    # A pass that ended early on this rank leaves a round behind; the next pass fails it, not finishes it.
    stale = powersgd_hook(state, makers[1](_grad(30, rank), index=1, is_last=False))
    fresh = powersgd_hook(state, makers[0](_grad(31, rank), index=0, is_last=True))
    with pytest.raises(RuntimeError, match=f"round of bucket 1 abandoned on rank {rank}"):
        stale.wait()
    _assert_powersgd_of_mean(fresh.wait(), 31)


def test_powersgd_finishes_each_round_at_the_next_bucket() -> None:
    run_distributed(_check_powersgd_rounds_across_buckets, W)


class _FirstLayerUnused(nn.Module):
    """The first layer (the last bucket backward fills) never takes part in forward.

    No biases: every bucket holds a matrix, so the last bucket launched leaves a round waiting.
    """

    def __init__(self) -> None:
        super().__init__()
        self.skipped = nn.Linear(16, 16, bias=False)
        self.a = nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.a(x)))


def _powersgd_with_the_last_bucket_skipped() -> dict[str, dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    grads: dict[str, dict[str, Any]] = {}
    for name in ("gradsync", "torch"):
        torch.manual_seed(0)
        model = _FirstLayerUnused()
        if name == "gradsync":
            ddp = DDP(model, find_unused_parameters=True, skip_all_reduce_unused_params=True, bucket_cap_mb=0.0001)
            lossless = _full_rank_state()
            ddp.register_comm_hook(lossless, powersgd_hook)
        else:
            ddp = TorchDDP(model, find_unused_parameters=True)
        for step in range(3):
            model.zero_grad(set_to_none=True)
            x, y = global_batch("mlp", world, step)
            loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        grads[name] = grads_of(model)
    # The iterations still count (they decide when compression starts), though no last bucket came.
    grads["iterations"] = {"counted": lossless.iter}
    return grads


def test_powersgd_with_skipped_last_buckets_matches_torch_ddp() -> None:
    """Buckets of one parameter each, the last ones skipped as unused: no round is left waiting."""
    for grads in run_distributed(_powersgd_with_the_last_bucket_skipped, W):
        ours, theirs = grads["gradsync"], grads["torch"]
        assert grads["iterations"]["counted"] == 3
        assert ours["skipped.weight"] is None and theirs["skipped.weight"] is None
        for name, grad in theirs.items():
            if grad is not None:
                assert torch.allclose(ours[name], grad, atol=1e-5), name


def _check_error_feedback_conserves_the_gradient(name: str) -> None:
    """With error feedback, what was applied plus what is still owed is all that was computed.

    PowerSGD keeps its errors divided by W (the ranks' errors add up to the debt), top-k
    and int8 in gradient units (their mean is the debt).
    """
    rank = dist.get_rank()
    make = Buckets()
    hook, state, errors_are_divided = {
        "powersgd": (powersgd_hook, PowerSGDState(None, start_iter=2), True),
        "batched_powersgd": (batched_powersgd_hook, PowerSGDState(None, start_iter=2), True),
        "topk": (topk_hook, TopKState(None, ratio=0.1), False),
        "int8": (int8_hook, Int8State(None), False),
    }[name]
    applied, computed = torch.zeros(NUMEL), torch.zeros(NUMEL)
    for step in range(6):
        applied += _run(hook, state, make(_grad(step, rank)))
        computed += _mean(step)
    # PowerSGD keeps its memory grouped by matrix shape; residual() reads it in the bucket's order.
    held = state.residual(0) if isinstance(state, PowerSGDState) else state.errors.get(0)
    debt = sum(_everyone(held))
    debt = debt if errors_are_divided else debt / W
    assert debt.abs().max() > 1e-3, "nothing was held back: the test would prove nothing"
    assert torch.allclose(applied + debt, computed, atol=1e-5), (applied + debt - computed).abs().max()


@pytest.mark.parametrize("name", ["powersgd", "batched_powersgd", "topk", "int8"])
def test_error_feedback_conserves_the_gradient(name: str) -> None:
    run_distributed(_check_error_feedback_conserves_the_gradient, W, name)


def _check_topk_and_int8() -> None:
    rank = dist.get_rank()
    make = Buckets()
    assert torch.equal(_run(topk_hook, TopKState(None, ratio=1.0), make(_grad(0, rank))), _mean(0))
    state = TopKState(None, ratio=0.25)
    k = math.ceil(0.25 * NUMEL)
    want = torch.zeros(NUMEL)
    for r in range(W):
        g = _grad(1, r)
        index = g.abs().topk(k).indices
        want[index] += g[index] / W
    assert torch.allclose(_run(topk_hook, state, make(_grad(1, rank))), want, atol=1e-7)
    assert state.wire.bytes_per_iteration == [k * (4 + 4)]  # int32 index + fp32 value, to one peer
    state = Int8State(None)
    got = _run(int8_hook, state, make(_grad(2, rank)))
    scale = max(_grad(2, r).abs().max() for r in range(W))
    step = scale / 127
    want = sum(torch.round(_grad(2, r) / step) for r in range(W)) * (step / W)
    assert torch.allclose(got, want, atol=1e-6)
    assert (got - _mean(2)).abs().max() <= scale / 127 / 2 + 1e-6  # half a quantisation step
    assert state.wire.bytes_per_iteration == [NUMEL + 4]  # int8 payload + the shared scale


def test_topk_and_int8_match_hand_reference() -> None:
    run_distributed(_check_topk_and_int8, W)


# ---------------------------------------------------------------------------- tier 3: under DDP
HOOKS: dict[str, Callable[[], tuple[Any, Callable[..., Any]]]] = {
    "allreduce": lambda: (AllReduceState(), allreduce_hook),
    "fp16": lambda: (AllReduceState(), fp16_compress_hook),
    "bf16": lambda: (AllReduceState(), bf16_compress_hook),
    "fp16_wrapper": lambda: (AllReduceState(), compress_wrapper(allreduce_hook, torch.float16)),
    "powersgd": lambda: (PowerSGDState(None, start_iter=10), powersgd_hook),
    "batched_powersgd": lambda: (
        PowerSGDState(None, matrix_approximation_rank=4, start_iter=10),
        batched_powersgd_hook,
    ),
    "bf16_powersgd": lambda: (PowerSGDState(None, start_iter=10), compress_wrapper(powersgd_hook, torch.bfloat16)),
    "topk": lambda: (TopKState(None, ratio=0.01), topk_hook),
    "int8": lambda: (Int8State(None), int8_hook),
}
COMPRESSING = [name for name in HOOKS if name != "allreduce"]


def _replicas_agree(model: nn.Module, what: str) -> None:
    replicas = all_gather_flat(list(model.parameters()))
    assert all(torch.equal(replicas[0], r) for r in replicas[1:]), f"replicas differ: {what}"


def _hooks_on_test_models(name: str) -> None:
    """Every hook on every kind of bucket (conv, fp64, sparse, several buckets, views): replicas agree."""
    rank = dist.get_rank()
    for model_name in ("mlp", "cnn_bn", "mixed_fp32_fp64", "sparse_embedding"):
        for as_view in (False, True):
            model = make_model(model_name)
            ddp = DDP(model, bucket_cap_mb=0.001, gradient_as_bucket_view=as_view)
            state, hook = HOOKS[name]()
            if isinstance(state, PowerSGDState):
                state.start_iter = 2
            ddp.register_comm_hook(state, hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
            for step in range(4):
                x, y = global_batch(model_name, W, step)
                opt.zero_grad()
                loss_fn(ddp(shard(x, rank, W)), shard(y, rank, W)).backward()
                opt.step()
                _replicas_agree(model, f"{name} on {model_name}, as_view={as_view}, step {step}")


@pytest.mark.parametrize("name", list(HOOKS))
def test_replicas_stay_identical_under_every_hook(name: str) -> None:
    run_distributed(_hooks_on_test_models, W, name)


def _lossless_settings_equal_plain_allreduce() -> None:
    rank = dist.get_rank()
    lossless = {
        "allreduce": (None, allreduce_hook),
        "powersgd before start_iter": (PowerSGDState(None, start_iter=5), powersgd_hook),
        "batched before start_iter": (PowerSGDState(None, start_iter=5), batched_powersgd_hook),
        "topk ratio 1.0": (TopKState(None, ratio=1.0), topk_hook),
    }
    for what, (state, hook) in lossless.items():
        plain_model = make_model("mlp")
        hooked_model = copy.deepcopy(plain_model)
        plain, hooked = DDP(plain_model, bucket_cap_mb=0.001), DDP(hooked_model, bucket_cap_mb=0.001)
        hooked.register_comm_hook(state, hook)
        for step in range(4):
            x, y = global_batch("mlp", W, step)
            for ddp in (plain, hooked):
                ddp.zero_grad()
                loss_fn(ddp(shard(x, rank, W)), shard(y, rank, W)).backward()
            for (pname, a), b in zip(grads_of(hooked_model).items(), grads_of(plain_model).values()):
                assert torch.equal(a, b), f"{what}: {pname} differs at step {step}"


def test_lossless_settings_equal_plain_allreduce_bit_for_bit() -> None:
    run_distributed(_lossless_settings_equal_plain_allreduce, W)


def _cast_hooks_match_single_process() -> None:
    rank = dist.get_rank()
    x, y = global_batch("mlp", W, 0)
    casts = ((allreduce_hook, torch.float32), (fp16_compress_hook, torch.float16), (bf16_compress_hook, torch.bfloat16))
    for hook, dtype in casts:
        model = make_model("mlp")
        reference = copy.deepcopy(model)
        ddp = DDP(model, bucket_cap_mb=0.001)
        ddp.register_comm_hook(AllReduceState(), hook)
        loss_fn(ddp(shard(x, rank, W)), shard(y, rank, W)).backward()
        (sum(loss_fn(reference(shard(x, r, W)), shard(y, r, W)) for r in range(W)) / W).backward()
        for (name, got), want in zip(grads_of(model).items(), grads_of(reference).values()):
            # Two roundings to dtype's precision, relative to the gradient's scale (fp32: the
            # single-process sum's own rounding dominates, hence the 1e-6 floor).
            tolerance = 2 * torch.finfo(dtype).eps * want.abs().max() + 1e-6
            assert (got - want).abs().max() <= tolerance, f"{dtype}: {name} off by {(got - want).abs().max()}"


def test_cast_hooks_match_single_process_within_dtype_precision() -> None:
    run_distributed(_cast_hooks_match_single_process, W)


# ---------------------------------------------------------------------------- convergence
STEPS, PER_RANK, DIM, CLASSES = 150, 32, 32, 4


def _blobs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four overlapping Gaussian blobs in 32 dimensions: learnable, not trivially separable."""
    centers = torch.randn(CLASSES, DIM, generator=torch.Generator().manual_seed(0)) * 0.35
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=generator)
    return centers[labels] + torch.randn(n, DIM, generator=generator), labels


def _blob_model() -> nn.Module:
    torch.manual_seed(0)  # 32*64 + 64*64 + 64*4 weights, 132 biases: 6,532 parameters
    return nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def _train_blobs(name: str) -> dict[str, Any]:
    rank = dist.get_rank()
    model = _blob_model()
    ddp = DDP(model)  # one bucket: the whole model fits in the first bucket's 1 MiB
    state, hook = HOOKS[name]()
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    train_x, train_y = _blobs(4096, seed=1)
    for step in range(STEPS):
        rows = torch.randint(0, len(train_x), (W * PER_RANK,), generator=torch.Generator().manual_seed(step))
        mine = rows[rank * PER_RANK : (rank + 1) * PER_RANK]
        opt.zero_grad()
        F.cross_entropy(ddp(train_x[mine]), train_y[mine]).backward()
        opt.step()
        if step % 50 == 49:
            _replicas_agree(model, f"{name} after step {step}")
    test_x, test_y = _blobs(2048, seed=2)
    with torch.no_grad():
        loss = F.cross_entropy(model(test_x), test_y).item()
    return {"loss": loss, "bytes": state.wire.mean_bytes_per_iteration(last=STEPS - 10)}


def _train_all() -> dict[str, dict[str, Any]]:
    return {name: _train_blobs(name) for name in HOOKS}


@pytest.fixture(scope="module")
def blob_runs() -> dict[str, dict[str, Any]]:
    per_rank = run_distributed(_train_all, W, timeout_s=120)
    assert per_rank[0] == per_rank[1], "ranks disagree on the final loss or the bytes sent"
    return per_rank[0]


def _expected_ratio(name: str) -> float:
    """fp32 all-reduce bytes over the hook's, from the model's shapes (W = 2, one bucket)."""
    weights, biases = [(64, 32), (64, 64), (4, 64)], 64 + 64 + 4
    n = sum(a * b for a, b in weights) + biases
    if name in ("fp16", "bf16", "fp16_wrapper"):
        return 2.0
    if name in ("powersgd", "bf16_powersgd"):
        element = 2 if name == "bf16_powersgd" else 4
        return 4 * n / (element * (sum(a + b for a, b in weights) + biases))
    if name == "batched_powersgd":
        return n / (2 * 4 * 81)  # 6,532 entries as 81 x 81, rank 4: P and Q of 81 x 4
    if name == "topk":
        return 4 * n / (8 * math.ceil(0.01 * n))
    if name == "int8":
        return 4 * n / (n + 4)
    return 1.0


# Final test loss may exceed plain all-reduce's by at most this much. Plain goes from 1.387
# to 0.429 here; measured gaps: fp16, bf16, int8 < 0.001, PowerSGD 0.003, batched PowerSGD
# (rank 4) 0.020, top-k (1%) 0.029. The same hooks without error feedback end at 0.85-1.01,
# so this tolerance does catch a hook whose error feedback is broken.
LOSS_TOLERANCE = 0.05


@pytest.mark.parametrize("name", COMPRESSING)
def test_compressing_hooks_converge_like_plain_allreduce(name: str, blob_runs: dict[str, dict[str, Any]]) -> None:
    plain, ours = blob_runs["allreduce"], blob_runs[name]
    assert plain["loss"] < 0.6, f"the task itself did not train: {plain['loss']:.3f}"
    assert ours["loss"] <= plain["loss"] + LOSS_TOLERANCE, f"{name}: {ours['loss']:.4f} vs plain {plain['loss']:.4f}"
    ratio = plain["bytes"] / ours["bytes"]
    assert ratio == pytest.approx(_expected_ratio(name), rel=0.01), f"{name}: measured ratio {ratio:.2f}"


def test_largest_indices_picks_what_topk_picks() -> None:
    """The sampled-threshold selection (topk.py) against torch.topk, and exactly k in awkward cases."""
    generator = torch.Generator().manual_seed(0)
    for n, k in [(3 << 20, 31457), (3 << 20, 1), (3 << 20, 2 << 20), (5000, 50)]:
        magnitude = torch.randn(n, generator=generator).abs()
        got = largest_indices(magnitude, k)
        want = magnitude.topk(k, sorted=False).indices
        assert torch.equal(got.sort().values, want.sort().values), (n, k)
    # ties at the threshold (mostly zeros): still exactly k, and every nonzero entry among them
    magnitude = torch.zeros(3 << 20)
    magnitude[:10] = 1.0
    got = largest_indices(magnitude, 30000)
    assert got.numel() == 30000 and set(range(10)) <= set(got.tolist())
    # a NaN makes comparisons false: the fallback still returns k indices
    magnitude = torch.rand(3 << 20, generator=generator)
    magnitude[5] = float("nan")
    assert largest_indices(magnitude, 30000).numel() == 30000
