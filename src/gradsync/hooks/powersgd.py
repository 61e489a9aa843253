"""PowerSGD: rank-r gradient compression with error feedback (Vogels et al., NeurIPS 2019).

Written from the paper. Each gradient matrix ``M`` (``n x m``) is approximated as
``P Q^T`` with ``P`` ``n x r`` and ``Q`` ``m x r``, found by one step of power iteration
that starts from last iteration's ``Q`` (warm start):

    P = M Q;  all-reduce P;  P = orthonormalise(P);  Q = M^T P;  all-reduce Q;  M ~ P Q^T

Only ``P`` and ``Q`` travel: ``r (n + m)`` numbers instead of ``n m``. What the
approximation misses on this rank, ``M - P Q_local^T``, is kept (error feedback) and
added to the next gradient, so nothing is lost for good, only delayed.

Two hooks share that round: ``powersgd_hook`` compresses each weight matrix of a bucket
on its own (the paper's layer-wise scheme); ``batched_powersgd_hook`` folds the whole
bucket into one square-ish matrix (cheaper to run, cruder approximation).

[Note: collective order]
Every rank must issue its collectives in the same order, or a process group pairs one
rank's ``P`` with another rank's ``Q``. So every collective here is issued by the hook
itself, on the thread that launches buckets in index order, never from a future's
callback (which runs whenever that collective happens to finish: torch's powerSGD_hook
does that and deadlocks on gloo with more than one bucket). A bucket's ``Q`` step, which
needs the summed ``P``, therefore runs at the hook's next call rather than in a callback
([Note: P in flight] in low_rank.py), so backward is not held up waiting for ``P``.

[Note: the scale of M]
The bucket is divided by the world size before anything else, so all-reducing (summing)
``P`` and ``Q`` yields the average directly, and the error memory is kept at that scale.
Because ``P`` is the same on every rank, summing the local ``Q`` is the same as summing
the local approximations: the ranks' errors add up to exactly what was not sent.

[Note: the error memory is the working matrix]
With error feedback on, ``M = error + bucket / W`` is formed in the error memory itself
(one fused pass, which also stacks same-shaped matrices: [Note: matrices stacked by shape] in
matrix_groups.py), the power iteration runs on it, and ``M - P Q^T`` is subtracted there in
place: what is left is next iteration's error, with no copy. The averaged result is then
written into the bucket's buffer. At low rank the hook is memory-bound (each pass reads
the whole bucket for a handful of flops per element), so it makes as few passes as it can:
a division and a copy of the bucket fewer than the textbook order of operations.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from ..engine.grad_bucket import GradBucket
from .allreduce import allreduce_future
from .denormals import flushed_denormals
from .low_rank import LowRankRound
from .matrix_groups import MatrixGroups, plan
from .memory import BucketMemory
from .product_forms import ProductForms
from .wire import WireStats

logger = logging.getLogger(__name__)


class PowerSGDState:
    """Knobs and per-bucket memories of ``powersgd_hook`` / ``batched_powersgd_hook``.

    ``errors`` holds each bucket's error-feedback residual, ``q_memory`` its warm-start
    ``Q``, both keyed by ``bucket.index()``; ``iter`` counts finished backward passes;
    ``wire`` records the bytes this rank sent per iteration.

    ``forms``: the form each rank-local product (``P = M Q``, ``Q = M^T P``, the residual) runs in:
    the fixed defaults, or with ``time_product_forms=True`` the form timed fastest on this machine per
    stack shape ([Note: forms chosen on the machine] in product_forms.py: off by default, because on
    the one machine where it mattered the parity study came out worse with it).

    ``prefers_few_buckets``: a few hundredths of the gradient go on the wire, so small buckets
    (which gradsync's default picks on a slow link, for uncompressed all-reduces to start
    early) only add per-bucket latency; the default then keeps torch's caps for this hook.
    """

    prefers_few_buckets = True

    __slots__ = (
        "process_group",
        "world_size",
        "rank",
        "matrix_approximation_rank",
        "start_iter",
        "min_compression_rate",
        "use_error_feedback",
        "warm_start",
        "seed",
        "iter",
        "errors",
        "q_memory",
        "layouts",
        "generator",
        "wire",
        "forms",
        "_in_flight",
        "_saw_last",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        matrix_approximation_rank: int = 1,
        start_iter: int = 2,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
        time_product_forms: bool = False,
    ) -> None:
        _check_args(matrix_approximation_rank, start_iter, min_compression_rate, use_error_feedback, warm_start)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.seed = seed
        self.iter = 0
        self.errors = BucketMemory()
        self.q_memory = BucketMemory()
        self.layouts: dict[
            int, tuple[tuple[int, ...], MatrixGroups]
        ] = {}  # per bucket: [Note: matrices stacked by shape]
        # Same seed and same sequence of draws on every rank: the initial Q agree everywhere,
        # which P = M Q needs for the all-reduce of P to mean anything.
        self.generator = torch.Generator().manual_seed(seed)
        self.wire = WireStats(self.world_size)
        self.forms = ProductForms(timed=time_product_forms)  # [Note: forms chosen on the machine] in product_forms.py
        self._in_flight: LowRankRound | None = None  # see [Note: P in flight] in low_rank.py
        self._saw_last = False  # this pass's last bucket came to the hook (and ended the iteration)

    def compressing(self) -> bool:
        return self.iter >= self.start_iter

    def layout_of(self, bucket: GradBucket) -> MatrixGroups:
        """The bucket's matrices grouped by shape, computed once while it holds the same parameters."""
        owner = tuple(id(p) for p in bucket.parameters())
        entry = self.layouts.get(bucket.index())
        if entry is None or entry[0] != owner:
            entry = (owner, plan(bucket, self.matrix_approximation_rank, self.min_compression_rate))
            self.layouts[bucket.index()] = entry
        return entry[1]

    def residual(self, index: int) -> torch.Tensor | None:
        """Bucket ``index``'s error-feedback memory in the bucket's order (for inspection and tests).

        ``powersgd_hook`` keeps it grouped by matrix shape ([Note: matrices stacked by shape]);
        this puts every element back at its gradient's place.
        """
        memory = self.errors.get(index)
        entry = self.layouts.get(index)
        return memory if memory is None or entry is None else entry[1].in_bucket_order(memory)

    def finish_launches(self) -> None:
        """The pass is over: finish the round left waiting for its ``P`` ([Note: P in flight]).

        gradsync's reducer calls it once every bucket of a pass was launched or skipped. When the
        last bucket was skipped (``skip_all_reduce_unused_params``), this also ends the iteration,
        which the last bucket's call would have done.
        """
        self._finish_waiting()
        if not self._saw_last:
            self._end_iteration()
        self._saw_last = False

    def _finish_waiting(self) -> None:
        waiting, self._in_flight = self._in_flight, None
        if waiting is not None:
            waiting.finish()

    def _begin_round(self, round_: LowRankRound, bucket: GradBucket) -> None:
        self._in_flight = round_
        if bucket.is_last():
            self._finish_waiting()

    def _settle_before(self, bucket: GradBucket) -> None:
        """Before bucket ``b``'s collectives: finish the earlier bucket's round of this pass."""
        waiting = self._in_flight
        if waiting is None:
            return
        if waiting.index < bucket.index():
            self._finish_waiting()
        else:  # a new pass began: the one that left it ended early on this rank
            self._in_flight = None
            waiting.fail(
                f"gradsync: PowerSGD round of bucket {waiting.index} abandoned on rank {self.rank}: the backward "
                "pass that launched it ended before its next bucket, and a new pass began."
            )

    def end_bucket(self, bucket: GradBucket) -> None:
        if bucket.is_last():
            self._saw_last = True
            self._end_iteration()

    def _end_iteration(self) -> None:
        self.iter += 1
        self.wire.end_iteration()
        if self.iter == self.start_iter and self.rank == 0:
            logger.info(
                "PowerSGD: compressing with rank %d from iteration %d on", self.matrix_approximation_rank, self.iter
            )


def _check_args(rank: int, start_iter: int, min_rate: float, error_feedback: bool, warm_start: bool) -> None:
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"matrix_approximation_rank must be an integer >= 1, got {rank!r}.")
    if not isinstance(start_iter, int) or start_iter < 0:
        raise ValueError(f"start_iter must be an integer >= 0, got {start_iter!r}.")
    if (error_feedback or warm_start) and start_iter <= 1:
        raise ValueError(
            f"start_iter={start_iter}: with use_error_feedback or warm_start on, PowerSGD must start at "
            "iteration 2 or later, because the buckets are rebuilt at the start of iteration 1 and the "
            "per-bucket memories would not survive that. Pass start_iter=2 (or more), or turn both off."
        )
    if min_rate < 0:
        raise ValueError(f"min_compression_rate must be >= 0, got {min_rate!r}.")


# ---------------------------------------------------------------------- error memory
def _add_error(state: PowerSGDState, bucket: GradBucket, target: torch.Tensor) -> None:
    if state.use_error_feedback:
        error = state.errors.lookup(bucket)
        if error is not None and error.shape == target.shape:
            target.add_(error)


def _plain(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    state._settle_before(bucket)
    fut = allreduce_future(bucket.buffer(), state.process_group, state.world_size, state.wire)
    state.end_bucket(bucket)
    return fut


# ---------------------------------------------------------------------- per-tensor hook


def powersgd_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress each weight matrix of the bucket to rank ``r``; all-reduce the rest as is.

    When to use it: bandwidth-bound training of models whose weights are matrices or
    convolutions (almost all of them), where even bf16 sends too much. With error
    feedback on, expect accuracy close to plain SGD's at a suitable rank.

    The knobs:

    * ``matrix_approximation_rank`` (r): the paper matched SGD's accuracy with r=2 on
      ResNet-18/CIFAR-10 and r=4 on an LSTM language model. Bytes and compute grow
      linearly with r; start low and raise it if the loss lags behind plain all-reduce.
    * ``start_iter``: plain all-reduce before it. The first steps move fast and change
      direction often; a warm-up of plain steps (often ~10% of training) makes
      compression easier on accuracy.
    * ``min_compression_rate``: a matrix ``n x m`` is compressed only when
      ``n m >= rate * r (n + m)``; the others (biases, norms, tiny layers) are all-reduced
      uncompressed in one flat tensor, where compression would save little.
    * ``use_error_feedback``: keep it on; without it the approximation error is lost and
      accuracy suffers. Costs one bucket-sized tensor per bucket.
    * ``warm_start``: reuse last iteration's ``Q``; one power iteration then tracks the
      gradient's top subspace over time. Costs ``r m`` numbers per matrix.

    Bytes on the wire per rank: ``2 (W - 1) / W * (sum of r (n + m) + uncompressed)``
    elements instead of ``2 (W - 1) / W * bucket numel``; a 1024 x 1024 layer at r=1 sends
    512 times less. The uncompressed elements travel in ``P``'s all-reduce, and each bucket's
    ``Q`` step runs at the next bucket's call ([Note: P in flight] in low_rank.py). Sparse
    buckets are all-reduced unchanged.
    """
    buffer = bucket.buffer()
    if buffer.is_sparse or not state.compressing():
        return _plain(state, bucket)
    state._settle_before(bucket)  # the earlier bucket's Q goes first: [Note: P in flight]
    groups = state.layout_of(bucket)
    work = _working_memory(state, bucket, buffer, groups)
    flat = groups.plain_part(work) if groups.has_plain else None
    if not groups.groups:  # then the bucket is all plain: flat is not None
        sent = flat.clone()  # type: ignore[union-attr]
        if state.use_error_feedback:
            flat.zero_()  # type: ignore[union-attr]  # sent exactly: nothing left over for error feedback
        fut = allreduce_future(sent, state.process_group, state.world_size, state.wire, divide=False)
        state.end_bucket(bucket)
        return fut.then(lambda f: _write_plain(groups, buffer, f.value()))

    def write(ps: list[torch.Tensor], qs: list[torch.Tensor], averaged: torch.Tensor | None) -> torch.Tensor:
        groups.write_products(buffer, ps, qs)
        if averaged is not None:
            groups.write_plain(buffer, averaged)
        return buffer

    stacks = groups.stacks(work)
    round_ = LowRankRound(state, bucket, stacks, [g.rank for g in groups.groups], flat, write)
    if flat is not None and state.use_error_feedback:
        flat.zero_()  # carried in P's all-reduce (copied there): nothing left over for error feedback
    state._begin_round(round_, bucket)  # the last bucket's round finishes here, inside its iteration
    state.end_bucket(bucket)
    return round_.result


def _write_plain(groups: MatrixGroups, buffer: torch.Tensor, averaged: torch.Tensor) -> torch.Tensor:
    """Put the uncompressed elements' average back at their places in the bucket."""
    groups.write_plain(buffer, averaged)
    return buffer


def _working_memory(
    state: PowerSGDState, bucket: GradBucket, buffer: torch.Tensor, groups: MatrixGroups
) -> torch.Tensor:
    """``error + buffer / W`` in the layout of ``groups``: in the error memory when error feedback is on.

    See [Note: the scale of M], [Note: the error memory is the working matrix] and
    [Note: matrices stacked by shape] (matrix_groups.py).
    """
    with flushed_denormals(buffer.device):  # [Note: denormals in a low-rank round] in denormals.py
        if not state.use_error_feedback:
            return groups.fresh_memory(buffer, state.world_size)
        error = state.errors.lookup(bucket)
        if error is None or error.shape != buffer.shape:
            error = groups.fresh_memory(buffer, state.world_size)
            state.errors.store(bucket, error)
        else:
            groups.to_memory(error, buffer, 1.0 / state.world_size)
        return error


# ---------------------------------------------------------------------- batched hook
def _square_ish(numel: int) -> tuple[int, int]:
    """The ``rows x cols`` matrix with rows = ceil(sqrt(numel)) that holds ``numel`` (padding < rows)."""
    rows = math.isqrt(numel - 1) + 1 if numel > 0 else 1
    return rows, max(1, -(-numel // rows))


def batched_powersgd_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress the whole bucket as one square-ish matrix to rank ``r``.

    When to use it: when ``powersgd_hook``'s per-layer matrix products cost too much
    (many small layers, slow CPUs) or when the model's weights are not matrices. The
    bucket is read row-wise as a ``ceil(sqrt(n))``-row matrix, zero-padded, which has no
    relation to the layers' structure: the approximation is much cruder, so keep error
    feedback on and expect to need a higher rank (4-16) than with ``powersgd_hook``.

    Knobs as for ``powersgd_hook``; ``min_compression_rate`` applies to the bucket matrix
    (a bucket that would not be compressed enough is all-reduced unchanged).

    Bytes on the wire per rank: ``2 (W - 1) / W * 2 r sqrt(n)`` elements for a bucket of
    ``n``, instead of ``2 (W - 1) / W * n``: for a 25 MiB fp32 bucket and r=4 that is
    about 320 times less. The bucket buffer is never resized; the padded matrix is a copy.
    """
    buffer = bucket.buffer()
    if buffer.is_sparse or not state.compressing():
        return _plain(state, bucket)
    n = buffer.numel()
    rows, cols = _square_ish(n)
    rank = min(state.matrix_approximation_rank, rows, cols)
    if rows * cols < state.min_compression_rate * rank * (rows + cols):
        return _plain(state, bucket)
    state._settle_before(bucket)
    padded = buffer.new_zeros(rows * cols)
    with flushed_denormals(buffer.device):  # [Note: denormals in a low-rank round] in denormals.py
        padded[:n].copy_(buffer).div_(state.world_size)  # see [Note: the scale of M]
        _add_error(state, bucket, padded[:n])
    matrix = padded.view(rows, cols)

    def write(ps: list[torch.Tensor], qs: list[torch.Tensor], _: torch.Tensor | None) -> torch.Tensor:
        buffer.copy_(torch.matmul(ps[0], qs[0].transpose(-2, -1)).view(-1)[:n])
        return buffer

    round_ = LowRankRound(state, bucket, [matrix.unsqueeze(0)], [rank], None, write)
    if state.use_error_feedback:
        # The memory is a view of the working matrix, which holds the residual once the round
        # has finished (no copy). The padding's residual means nothing and is never read.
        state.errors.store(bucket, padded[:n])
    state._begin_round(round_, bucket)  # the last bucket's round finishes here, inside its iteration
    state.end_bucket(bucket)
    return round_.result
