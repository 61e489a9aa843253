"""Bad contributions left out: an outer gradient that is not finite (or, by choice, too large) is not averaged in.

[Note: bad contributions are left out]
A replica whose outer gradient holds a NaN or an infinity (it diverged, a batch was bad, a bit
flipped) would make ``theta_global`` non-finite on every replica through the average, at once and
for good. So before each outer exchange every process describes its own outer gradient in four
numbers, in the training thread as the exchange starts (``health``): whether it is finite, its
norm, the first parameter that is not finite, and (only when it is not finite) whether its inner
optimizer's state still is. The exchange's first collective, on the exchange's side of the round,
all-gathers these (``4 x world_size`` float64: the whole cost, beside one ``isfinite`` and one norm
over the fragment) and every process derives the same verdict from them:
- an island (a replica: an island of one) is *excluded* when any member's outer gradient is not
  finite, or, with ``max_norm_ratio=r`` and at least three finite contributors, when its norm is
  over ``r`` times the median of the others' norms;
- the excluded send zeros and the others average without them, dividing by the contributors:
  exactly the average a death would leave, and ``theta_global`` stays the same bits everywhere;
- the excluded replica applies the same outer step, then starts its inner steps again from the
  new ``theta_global`` (every fragment's, not only the landing one: a NaN anywhere spreads to
  every parameter within an inner step), and its inner optimizer's state is copied from the first
  member of a kept island when its own is not finite ([Note: fault-tolerant DiLoCo] says why a
  copy is better than a fresh start);
- the exclusion is named on every process (a warning and an entry of ``run.history``: the
  islands, their ranks, the outer step, the first parameter), and an island excluded
  ``max_exclusions`` outer steps in a row ends its processes with an error saying so: their
  launcher restarts them, and they are healed from a live island like any restarted one.
A redo after a death describes the same outer gradients again over the survivors, so the verdict
of the step that commits is the one every survivor applies.
"""

from __future__ import annotations

import logging
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..diloco.outer_params import Fragment
from ..elastic.run import ElasticRun
from .inner_state import InnerState

logger = logging.getLogger(__name__)

_FIELDS = 4  # finite, norm, first non-finite parameter (-1: none), inner optimizer state finite


@dataclass(frozen=True)
class Verdict:
    """Who is left out of one outer step, and why; the same on every process."""

    excluded: list[int] = field(default_factory=list)  # islands (outer ranks: positions in island order)
    reasons: dict[int, str] = field(default_factory=dict)
    parameters: dict[int, str] = field(default_factory=dict)  # an excluded island's first non-finite parameter
    reheal: list[int] = field(default_factory=list)  # excluded islands whose inner optimizer state is not finite
    contributors: int = 0
    mine: bool = False  # whether this process's island is excluded

    def describe(self, names: list[str]) -> str:
        return "; ".join(
            f"island {names[i]!r} ({self.reasons[i]}"
            + (f", first in parameter {self.parameters[i]!r}" if i in self.parameters else "")
            + ")"
            for i in self.excluded
        )


def health(delta: torch.Tensor, sizes: list[int], inner: InnerState) -> torch.Tensor:
    """This process's four numbers about its outer gradient ``delta`` (parameters of ``sizes``)."""
    finite = bool(torch.isfinite(delta).all())
    first = -1
    inner_finite = True
    if not finite:
        first = next(i for i, part in enumerate(delta.split(sizes)) if not bool(torch.isfinite(part).all()))
        inner_finite = inner.finite()
    norm = float(torch.linalg.vector_norm(delta.double())) if finite else float("inf")
    return torch.tensor([float(finite), norm, float(first), float(inner_finite)], dtype=torch.float64)


def judge(
    rows: torch.Tensor, islands: list[list[int]], names: list[str], max_norm_ratio: float | None, me: int
) -> Verdict:
    """The verdict from every process's four numbers (``rows``, by global rank); ``me``: this process's rank."""
    finite = [bool(rows[ranks, 0].min() > 0) for ranks in islands]
    norms = [float(rows[ranks[0], 1]) for ranks in islands]
    reasons: dict[int, str] = {}
    parameters: dict[int, str] = {}
    reheal = []
    for i, ranks in enumerate(islands):
        if not finite[i]:
            reasons[i] = "its outer gradient is not finite"
            first = [int(rows[r, 2]) for r in ranks if rows[r, 2] >= 0]
            if first:
                parameters[i] = names[first[0]]
            if any(rows[r, 3] == 0 for r in ranks):
                reheal.append(i)
    kept = [i for i in range(len(islands)) if finite[i]]
    if max_norm_ratio is not None and len(kept) >= 3:
        for i in kept:
            median = statistics.median(norms[j] for j in kept if j != i)
            if norms[i] > max_norm_ratio * median:
                ratio = f"{max_norm_ratio:g}x the median {median:.4g} of the others'"
                reasons[i] = f"its outer gradient's norm {norms[i]:.4g} is over {ratio}"
    excluded = sorted(reasons)
    island = next(i for i, ranks in enumerate(islands) if me in ranks)
    return Verdict(excluded, reasons, parameters, reheal, len(islands) - len(excluded), island in excluded)


class ContributionScreen:
    """Derives each outer step's verdict from every process's ``health`` (collective over the generation)."""

    def __init__(self, max_norm_ratio: float | None, max_exclusions: int) -> None:
        if max_norm_ratio is not None and not max_norm_ratio > 1.0:
            raise ValueError(f"max_norm_ratio must be over 1 (or None to turn the rule off), got {max_norm_ratio}.")
        if max_exclusions < 1:
            raise ValueError(f"max_exclusions must be at least 1, got {max_exclusions}.")
        self.max_norm_ratio = max_norm_ratio
        self.max_exclusions = max_exclusions
        self.in_a_row = 0  # outer steps this process's island was excluded in a row

    def verdict(
        self,
        mine: torch.Tensor,
        islands: list[list[int]],
        names: list[str],
        collective: Callable[..., None],
    ) -> Verdict:
        """Every process's numbers all-gathered over the default group (the generation's), then judged."""
        world = dist.get_world_size()
        every = [torch.empty(_FIELDS, dtype=torch.float64) for _ in range(world)]
        collective(dist.all_gather, every, mine)
        return judge(torch.stack(every), islands, names, self.max_norm_ratio, dist.get_rank())

    def count(self, verdict: Verdict) -> int:
        """This island's exclusions in a row, after ``verdict`` was applied."""
        self.in_a_row = self.in_a_row + 1 if verdict.mine else 0
        return self.in_a_row

    def apply(
        self,
        verdict: Verdict,
        run: ElasticRun,
        outer_step: int,
        fragments: list[Fragment],
        inner: InnerState,
    ) -> None:
        """After outer step ``outer_step`` left islands out (DiLoCo applied it): name them; the excluded restart
        from theta_global, their inner optimizer healed when it is not finite; one excluded too often ends."""
        generation = run.generation
        assert generation is not None, "a verdict applied outside a generation"
        names, islands = generation.island_names(), generation.island_ranks()
        what = verdict.describe(names)
        ranks = [r for i in verdict.excluded for r in islands[i]]
        run.history.append({
            "generation": generation.number, "reason": "bad contribution left out", "outer_step": outer_step,
            "excluded": [names[i] for i in verdict.excluded], "ranks": ranks, "why": what,
            "parameters": [verdict.parameters.get(i) for i in verdict.excluded],
        })  # fmt: skip
        message = f"gradsync.elastic_diloco: outer step {outer_step} left out {what} (global ranks {ranks})"
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)
        if verdict.mine:
            with torch.no_grad():
                for fragment in fragments:  # every fragment: a NaN anywhere spreads to all in one inner step
                    fragment.write(fragment.theta.detach())
        if verdict.reheal:
            _reheal(verdict, islands, inner, fragments[0].params[0].device)  # the model's (theta may be on the host)
        mine = next(i for i, r in enumerate(islands) if dist.get_rank() in r)
        if self.count(verdict) >= self.max_exclusions:
            raise RuntimeError(
                f"gradsync.elastic_diloco: island {names[mine]!r} (rank {dist.get_rank()}) was left out of "
                f"{self.in_a_row} outer steps in a row (max_exclusions={self.max_exclusions}), the last time "
                f"because {what}. Its processes end here so that their launcher restarts them; they are then "
                "admitted and healed from a live replica."
            )


def _reheal(verdict: Verdict, islands: list[list[int]], inner: InnerState, device: torch.device) -> None:
    """The inner optimizer's state of the first kept island, taken by the excluded islands whose own is not
    finite (collective over the generation: every process knows the verdict)."""
    kept = [i for i in range(len(islands)) if i not in verdict.excluded]
    if not kept:
        return  # nobody to copy from: the excluded go on with theirs (the outer step had no contributor)
    inner.copy(islands, kept[0], verdict.reheal, device)
