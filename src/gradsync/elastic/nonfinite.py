"""Leaving a rank's non-finite gradients out of a step: ``FaultTolerant(reject_nonfinite=True)``.

[Note: non-finite gradients]
One rank's NaN or inf, averaged in, makes every replica's parameters NaN. With
``reject_nonfinite`` such a rank is left out of that step as a dead one would be, with no
collective beyond the step's vote:
1. After backward each rank looks at its own local gradients (the fault-tolerant mode keeps them
   in ``.grad`` until the step commits): one ``isfinite`` pass, one flag per gradient, one sync.
   Its result is the index of the first parameter (registration order) whose gradient is not
   finite, or none.
2. The vote (commit.py) carries one more int64 per rank, reduced with MIN like the rest: each
   rank writes that index in its own slot and a value above any index in the others'. After the
   vote every rank knows which ranks are bad *and their first bad parameter*: the model is the
   same everywhere, so an index is a name on every rank. The name is in every rank's warning and
   history entry at no further cost.
3. Such a vote commits nothing (the step's averages hold the bad values). The bad ranks zero
   their local gradients (their batch of the step is lost, as a dead rank's is); every rank, the
   bad ones included, reduces again (``reduce_again``, as after a death) and divides the sum by
   the number of ranks kept (``divide_next_pass_by``; with ``divisor=<int>`` that count stays, as
   it does after a death). Then they vote again: it commits, and every rank, the bad ones too,
   applies the same average, so replicas stay bitwise equal. With every rank bad nothing is left
   to average: the step is dropped (``step()`` returns False everywhere, the step counter stays).
4. A rank says "leave me out" only while the last reduction of the step still counts it: its
   gradients are not finite, or they were zeroed and a redo after a death divided by the whole new
   group (then the next vote leaves it out again, and the history has a second entry for the
   step). So the redo's count is always the group's size minus the flagged ranks. A vote that
   completes on some members and fails on others is settled as any failed vote (settle.py): those
   that redo find the others settling in their waits and settle too; the abort is redone by all.
5. A rank left out of ``max_exclusions`` steps in a row (dropped steps count) leaves the run
   (``run.leave()``, so the others do not wait for its heartbeat) and raises
   ``NonFiniteGradients`` naming its steps and parameter: its process exits, the launcher restarts
   it, and it joins again and is healed from a live replica, as any replacement.
Refused: a comm hook divides by the group's size inside the hook, so the kept ranks' average
cannot be made from it exactly; a ``ShardedOptimizer``'s step cannot be redone (its shards hold
the step's sums: [Note: a sharded optimizer under the fault-tolerant mode] in sharded_state.py);
replicas built with different values (the vote's size would differ: ``FaultTolerant._rewire``).
Cost when nothing is wrong: the ``isfinite`` pass and world-size more int64s in the vote.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .run import ElasticRun

logger = logging.getLogger(__name__)


class NonFiniteGradients(RuntimeError):
    """A rank's gradients were non-finite ``max_exclusions`` steps in a row: it exits to be restarted and healed."""


def check_options(ddp: Any, optimizer: Any, reject_nonfinite: bool, max_exclusions: int) -> None:
    """Refuse what ``reject_nonfinite`` cannot do ([Note: non-finite gradients])."""
    if not isinstance(max_exclusions, int) or isinstance(max_exclusions, bool) or max_exclusions < 1:
        raise ValueError(f"max_exclusions must be a positive int, got {max_exclusions!r}.")
    if not reject_nonfinite:
        return
    if ddp.engine.reduction.hook is not None:
        raise ValueError(
            f"reject_nonfinite=True cannot be used with a comm hook ({ddp.engine.reduction.name}): the hook "
            "divides by the group's size inside itself, so a step without a rank's gradients could not be "
            "averaged over the ranks kept. Remove the hook, or leave reject_nonfinite off."
        )
    if hasattr(optimizer, "describe_lost_shards"):
        raise ValueError(
            "reject_nonfinite=True cannot be used with a ShardedOptimizer: leaving a rank out redoes the step's "
            "reduction, and a sharded optimizer's step cannot be redone (its shards hold the step's sums). Use a "
            "replicated optimizer, or leave reject_nonfinite off."
        )


def first_nonfinite(params: list[torch.nn.Parameter]) -> int | None:
    """The index of the first of ``params`` whose local gradient holds a NaN or an inf; None if none does."""
    grads = [(i, p.grad) for i, p in enumerate(params) if p.grad is not None]
    if not grads:
        return None
    finite = torch.stack([(g._values() if g.is_sparse else g).isfinite().all() for _, g in grads])
    if bool(finite.all()):
        return None
    return grads[int((~finite).nonzero()[0])][0]


class NonFiniteGuard:
    """One rank's side of ``reject_nonfinite``: its check, its word in the vote, its exclusions in a row."""

    def __init__(self, enabled: bool, max_exclusions: int) -> None:
        self.enabled = enabled
        self.max_exclusions = max_exclusions
        self.first: int | None = None  # this step: the index of this rank's first non-finite gradient
        self.left_out = False  # this step: this rank's gradients were zeroed, its batch is lost
        self.counted = True  # the last reduction of this step divided by a count that includes this rank
        self.in_a_row: list[int] = []  # the steps this rank was left out of, in a row
        self.parameter = ""  # the name of this rank's last non-finite parameter

    def check(self, params: list[torch.nn.Parameter], names: list[str]) -> None:
        """A new step: look at this rank's local gradients (step 1 of the note)."""
        self.first = first_nonfinite(params) if self.enabled else None
        self.left_out, self.counted = False, True
        if self.first is not None:
            self.parameter = names[self.first]

    def vote(self) -> int | None:
        """What this rank writes in its slot of the vote (step 4 of the note): None for "count me"."""
        return self.first if self.counted else None

    def leave_out(self, params: list[torch.nn.Parameter]) -> None:
        """This rank is left out: its gradients become zeros for the redo (step 3 of the note)."""
        with torch.no_grad():
            for param in params:
                if param.grad is not None:
                    param.grad.zero_()
        self.left_out, self.counted = True, False

    def reduced_again(self, fixed_divisor: bool) -> None:
        """A redo after a membership change divided by the whole group, unless the divisor is fixed."""
        self.counted = not (self.left_out and fixed_divisor)

    def after_step(self, step: int, rank: int, run: ElasticRun) -> None:
        """Step ``step`` was committed (or dropped): count an exclusion; leave and raise after too many in a row."""
        if not self.left_out:
            self.in_a_row = []
            return
        self.in_a_row.append(step)
        if len(self.in_a_row) < self.max_exclusions:
            return
        run.leave()  # the others do not wait for this process's heartbeat
        raise NonFiniteGradients(
            f"Rank {rank}: its local gradients were not finite at steps {self.in_a_row} (first non-finite parameter: "
            f"{self.parameter!r}), {len(self.in_a_row)} steps in a row (max_exclusions={self.max_exclusions}); each "
            "time they were left out of the step's average. This process leaves the run so that its launcher "
            "restarts it (torchrun --max-restarts) and it is healed from a live replica. If it keeps happening, look "
            "at this rank's data and device, or lower the learning rate."
        )


def record(run: ElasticRun, step: int, nonfinite: dict[int, int], names: list[str], rank: int) -> None:
    """The warning and the ``run.history`` entry of a step that leaves ranks out, on every rank."""
    generation = run.generation
    assert generation is not None, "a step was voted on before this process was a member"
    excluded = sorted(nonfinite)
    parameters = [names[nonfinite[r]] for r in excluded]
    kept = len(generation.members) - len(excluded)
    entry = {
        "generation": generation.number,
        "reason": "non-finite gradients",
        "step": step,
        "excluded": excluded,
        "parameter": parameters[0],
        "parameters": parameters,
        "members": [generation.members[r] for r in excluded],
        "kept": kept,
    }
    run.history.append(entry)
    named = ", ".join(f"rank {r} ({p!r})" for r, p in zip(excluded, parameters))
    outcome = f"averaged over the {kept} other rank(s)" if kept else "every rank's is: the step is dropped"
    mine = " This rank's batch of the step is lost." if rank in nonfinite else ""
    logger.warning(
        "gradsync.elastic: step %d: non-finite local gradients on %s (first such parameter); left out of the "
        "step, which is %s.%s",
        step, named, outcome, mine,
    )  # fmt: skip
