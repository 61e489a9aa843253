"""``FaultTolerant``: training that goes on when a rank dies, and heals a replacement.

[Note: a step is decided before it is written] (see also engine/tolerance.py)
``loss.backward()`` reduces as usual, but a failed collective is noted rather than raised, and the
averages wait in the buckets. ``ft.step()`` then
1. asks every member to decide together whether the step commits: a vote over the group when
   nothing failed (commit.py), else through the store (settle.py);
2. commit: writes the averages to ``.grad``, runs ``optimizer.step()``; if joiners arrived, forms
   the next generation with them and heals them;
3. abort (a member died, hung, or a collective failed): forms the next generation of the live
   members (membership.py), re-syncs their state from the heal source, reduces the survivors'
   *local* gradients again over it, and goes back to 1. Only the dead ranks' batches are lost.
A process found too late for a generation (it was hung, say) joins again and is healed; its
``step()`` returns False. A step fails twice with every member alive: that is no death, so it is
raised. With ``reject_nonfinite`` a vote that finds non-finite gradients on some ranks redoes the
reduction without them, then votes again ([Note: non-finite gradients] in nonfinite.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..engine import errors
from ..observability.divergence import fingerprint
from ..wrapper.data_parallel import DataParallelWrapper
from . import commit, heal, hook_state, membership, nonfinite, settle
from .reconfiguration import Reconfiguration
from .run import ElasticRun, current
from .sharded_state import ShardedState, as_sharded, lost_shards_error
from .step_decision import StepDecider

logger = logging.getLogger(__name__)


class HealMismatch(Exception):
    """Members differ after a heal (never expected: the state is copied bit for bit)."""


class FaultTolerant:
    """Wraps a gradsync DDP model and its optimizer for a run joined with ``elastic.init``.

    ``step()`` replaces ``optimizer.step()`` and returns whether the step was committed.
    ``extra_state``: objects with ``state_dict``/``load_state_dict`` (a scheduler, a sampler's
    position) that a joiner receives too. ``on_reconfigure(rank, world_size, step)`` runs on every
    member after every membership change (e.g. to reshard the data). ``divisor``: "survivors"
    averages over the current members; an int divides every step's sum by that fixed count.
    ``reject_nonfinite``: a rank whose local gradients hold a NaN or an inf is left out of that step's
    average; after ``max_exclusions`` such steps in a row it raises ``NonFiniteGradients`` (to be
    restarted and healed): [Note: non-finite gradients] in nonfinite.py.
    """

    def __init__(
        self,
        ddp: DataParallelWrapper,
        optimizer: torch.optim.Optimizer,
        *,
        run: ElasticRun | None = None,
        extra_state: dict[str, Any] | None = None,
        on_reconfigure: Callable[[int, int, int], None] | None = None,
        divisor: str | int = "survivors",
        reject_nonfinite: bool = False,
        max_exclusions: int = 3,
    ) -> None:
        if not isinstance(ddp, DataParallelWrapper):
            raise TypeError(f"FaultTolerant wraps a gradsync.DistributedDataParallel, got {type(ddp).__name__}.")
        if ddp.gradient_as_bucket_view:
            raise ValueError(
                "FaultTolerant needs each rank's local gradient until a step commits, so it cannot use "
                "gradient_as_bucket_view=True (the all-reduce would overwrite .grad). Wrap the model without it."
            )
        if ddp.engine.fused_optimizer is not None:
            raise ValueError(
                "FaultTolerant decides each step after backward, so the optimizer cannot step inside it: "
                "use a plain optimizer instead of _register_fused_optim."
            )
        if ddp.engine.desync is not None:
            raise ValueError(errors.desync_under_fault_tolerance(dist.get_rank()))
        if divisor != "survivors" and not (isinstance(divisor, int) and divisor > 0):
            raise ValueError(f"divisor must be 'survivors' or a positive int, got {divisor!r}.")
        if isinstance(divisor, int) and ddp.engine.reduction.hook is not None:
            raise ValueError("divisor=<int> averages without a comm hook only: comm hooks divide by the group's size.")
        hook_state.check_supported(ddp.engine.reduction.state)
        nonfinite.check_options(ddp, optimizer, reject_nonfinite, max_exclusions)
        self.ddp = ddp
        self.optimizer = optimizer
        self.run = run or current()
        self.extra_state = extra_state or {}
        self.on_reconfigure = on_reconfigure
        self.divisor = divisor
        # A sharded optimizer: [Note: a sharded optimizer under the fault-tolerant mode] in sharded_state.py.
        self._sharded: ShardedState | None = as_sharded(optimizer)
        self._step = 0
        self.nonfinite = nonfinite.NonFiniteGuard(reject_nonfinite, max_exclusions)  # (nonfinite.py)
        self.decider = StepDecider(self.run)  # the vote, settling, and waiting on the group (step_decision.py)
        self.membership = Reconfiguration(
            self.run,
            "gradsync.elastic",
            lambda generation, aborted: self._open_and_heal(generation, reset_hook_memory=aborted),
            committed_step=lambda: self._step,
            describe=lambda: {"step": self._step},
            after=self._reconfigured,
            check=self._check_no_shard_lost,
        )
        if self.run.joining:
            self.membership.join()
        else:
            layout = [self._layout()]
            dist.broadcast_object_list(layout, src=0)  # one layout for all ([Note: a joiner's buckets])
            self._rewire(layout[0])

    # ------------------------------------------------------------------ what users read
    @property
    def step_count(self) -> int:
        """Committed optimizer steps so far (the same on every member)."""
        return self._step

    @property
    def generation(self) -> int:
        return self.run.generation.number if self.run.generation else -1

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def members(self) -> list[str]:
        """The current members' ids, in rank order."""
        return list(self.run.generation.members) if self.run.generation else []

    def replicas_identical(self) -> bool:
        """Whether every member holds the same parameters and optimizer state, bit for bit.

        Buffers are left out: BatchNorm statistics differ after each rank's own forward, as with
        DDP, until the next forward broadcasts them (after a heal they are compared too).
        """
        every = self._fingerprints(buffers=False)
        return all(torch.equal(theirs, every[0]) for theirs in every)

    def close(self) -> None:
        """Leave the run on purpose, after the last step (peers do not take it for dead)."""
        self.run.leave()

    # ------------------------------------------------------------------ the step
    def step(self) -> bool:
        """Agree on this step with the other members and apply it: True once it is committed.

        False when this process's batch of the step was dropped: it was left out of the next
        generation (it joined again and was healed), or the step was aborted while some member
        held no local gradients to redo it with ([Note: settling a step] in settle.py).
        """
        engine = self.ddp.engine
        if engine.tolerance.deferred is None and not engine.tolerance.failures:
            raise RuntimeError(
                f"FaultTolerant.step() on rank {self.rank} found no reduced gradients: run a synced forward and "
                "backward through the wrapped model first (not inside no_sync())."
            )
        self.nonfinite.check(engine.params, engine.names)
        retried_with_all_alive = False
        while True:
            generation = self.run.member_generation
            try:
                decision, by_vote = self._decide()
            except settle.Revoked as revoked:
                self._revoked(generation, revoked)
                return False
            if self.decider.nonfinite:  # redo without the ranks named: [Note: non-finite gradients]
                if not self._leave_out(self.decider.nonfinite):
                    return False  # every rank's gradients were: the step is dropped
                continue
            if decision.commit:
                self._apply(decision, by_vote)
                self.decider.wait_for_a_silent_store()
                self.nonfinite.after_step(self._step - 1, self.rank, self.run)
                return True
            engine.tolerance.drop_step()
            before = set(generation.members)
            if not self._reconfigure(generation.members, generation.members, f"step aborted: {decision.reason}", True):
                return False  # this process was left out; it joined again and was healed
            if not decision.redo:
                return False  # a member had no local gradients of this step: its batches are dropped
            if before == set(self.run.member_generation.members):
                if retried_with_all_alive:
                    raise RuntimeError(
                        f"Rank {self.rank}: step {self._step} failed twice although every member is alive: "
                        f"{decision.reason}"
                    )
                retried_with_all_alive = True
            engine = self.ddp.engine
            engine.reduce_again()
            self.nonfinite.reduced_again(fixed_divisor=isinstance(self.divisor, int))

    def _decide(self) -> tuple[commit.Decision, bool]:
        """This step's decision, and whether the vote made it (step_decision.py)."""
        tolerance = self.ddp.engine.tolerance
        failures = tolerance.failures
        guard = self.nonfinite
        decision, by_vote = self.decider.decide(
            self._step, failures, self._arrivals_known(), tolerance.abandoned, guard.enabled, guard.vote()
        )
        if decision.commit and failures:
            raise RuntimeError(
                f"Rank {self.rank}: step {self._step} was settled as committed although this member's reduction "
                f"failed ({failures[0]}), so it never voted: a bug in gradsync.elastic's commit protocol."
            )
        return decision, by_vote

    def _leave_out(self, ranks: dict[int, int]) -> bool:
        """Reduce this step again without ``ranks`` (rank -> its first non-finite parameter); False if
        no rank is left, and the step is dropped ([Note: non-finite gradients] in nonfinite.py)."""
        engine = self.ddp.engine
        nonfinite.check_options(self.ddp, self.optimizer, True, self.nonfinite.max_exclusions)  # a hook added since
        nonfinite.record(self.run, self._step, ranks, engine.names, self.rank)
        engine.tolerance.drop_step()
        if self.rank in ranks:
            self.nonfinite.leave_out(engine.params)
        kept = self.world_size - len(ranks)
        if kept == 0:
            self.nonfinite.after_step(self._step, self.rank, self.run)
            return False
        if not isinstance(self.divisor, int):
            engine.divisor.divide_next_pass_by(kept)
        engine.reduce_again()
        return True

    def _arrivals_known(self) -> int:
        """What this member votes: the arrivals it knows of (none new with a sharded optimizer, which admits no one)."""
        if self._sharded is not None:
            return self.run.arrivals_seen
        return max(self.run.heartbeat.arrivals_known, self.run.arrivals_seen)

    def _apply(self, decision: commit.Decision, by_vote: bool) -> None:
        engine = self.ddp.engine
        engine.write_deferred()
        engine.tolerance.drop_step()
        self.optimizer.step()
        self.decider.applied(self._step, decision, by_vote)
        self._step += 1
        run = self.run
        run.arrivals_seen = decision.arrivals_seen
        generation = run.member_generation
        if decision.admit:
            for joiner in decision.admit:
                run.store.set(run.keys.admitted(joiner), str(generation.number + 1))
            reason = f"admitting {len(decision.admit)} joiner(s)"
            self._reconfigure(generation.members + decision.admit, generation.members, reason, False)
        elif not by_vote:  # settled: the vote failed somewhere, so this generation's group is broken
            self._reconfigure(generation.members, generation.members, "the commit vote failed", True)

    def _revoked(self, generation: membership.Generation, revoked: settle.Revoked) -> None:
        """The others aborted a step this member committed: it joins again and is healed."""
        logger.warning("gradsync.elastic: %s while this process was taken for dead; joining again", revoked)
        run = self.run
        membership.decline(run.store, run.keys, generation.number + 1, run.uuid)  # nobody waits for it
        entry = {"generation": generation.number, "reason": f"revoked: {revoked}", "revoked": self._step - 1}
        run.history.append(entry)
        self.ddp.engine.tolerance.drop_step()
        self.decider.forget_vote()
        self.membership.rejoin()

    # ------------------------------------------------------------------ membership changes
    def _reconfigure(self, candidates: list[str], healthy: list[str], reason: str, aborted: bool) -> bool:
        """Form the next generation from ``candidates`` and heal it; False if this process was left out of
        it (it has then joined again and been healed)."""
        if self.membership.change(candidates, healthy, reason, aborted):
            return True
        self.membership.rejoin()
        return False

    def _reconfigured(self) -> None:
        if self.on_reconfigure is not None:
            self.on_reconfigure(dist.get_rank(), dist.get_world_size(), self._step)

    def _check_no_shard_lost(self, candidates: list[str], generation: membership.Generation, reason: str,
                             aborted: bool) -> None:  # fmt: skip
        if self._sharded is not None and aborted:
            raise lost_shards_error(self._sharded, candidates, generation, reason, self.rank, self._step)

    def _open_and_heal(self, generation: membership.Generation, reset_hook_memory: bool) -> None:
        membership.open_group(self.run.store, self.run.keys, generation, self.run.uuid, self.run.timeout_s)
        self.run.generation = generation
        self.run.heartbeat.watch(generation.members)
        source = generation.source
        # Members that all hold the state agree on parameters and optimizer state already (every
        # committed step was applied by all of them): only what can differ travels.
        everything = len(generation.healthy) < len(generation.members)
        payload = self._payload(everything) if dist.get_rank() == source else None
        state = heal.transfer(payload, source, membership.world(), self.ddp.engine.buckets.device)
        self._rewire(state["layout"])
        if dist.get_rank() != source:
            heal.load(self.ddp.module, self.optimizer, state)
            for name, obj in self.extra_state.items():
                obj.load_state_dict(state["extra"][name])
            self._step = state["step"]
            self.run.arrivals_seen = state["arrivals_seen"]
        engine = self.ddp.engine
        params = [storage.params for storage in engine.buckets.storages]
        hook_state.adopt(engine.reduction.state, state["hook"], params, reset_hook_memory)
        self._check_identical(generation)

    def _payload(self, everything: bool) -> dict[str, Any]:
        """What the heal source sends: the whole state for joiners, else what may differ (buffers)."""
        engine = self.ddp.engine
        model = self.ddp.module.state_dict() if everything else dict(self.ddp.module.named_buffers())
        return {
            "step": self._step,
            "arrivals_seen": self.run.arrivals_seen,
            "layout": self._layout(),
            "model": model,
            "optimizer": self.optimizer.state_dict() if everything else None,
            "hook": hook_state.share(engine.reduction.state, len(engine.buckets.storages)),
            "extra": {name: obj.state_dict() for name, obj in self.extra_state.items()},
        }

    def _check_identical(self, generation: membership.Generation) -> None:
        """The divergence check's fingerprint over everything a heal makes equal; a difference is a bug."""
        every = self._fingerprints(buffers=True)
        differ = [rank for rank, theirs in enumerate(every) if not torch.equal(theirs, every[generation.source])]
        if differ:
            raise HealMismatch(
                f"after healing generation {generation.number} from rank {generation.source}, rank(s) {differ} "
                "still differ from it."
            )

    def _fingerprints(self, buffers: bool) -> list[torch.Tensor]:
        """Every member's divergence-check fingerprint (observability/divergence.py) of its parameters (and buffers) and
        optimizer state, by rank."""
        module = self.ddp.module
        tensors = list(module.state_dict().values()) if buffers else list(module.parameters())
        tensors += [t for s in self.optimizer.state_dict()["state"].values() for t in s.values() if torch.is_tensor(t)]
        mine = fingerprint(tensors)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return every

    def _layout(self) -> dict[str, Any]:
        """The buckets every member builds ([Note: a joiner's buckets] in heal.py), and the vote's size."""
        return {**self.ddp.engine.layout.describe(), "reject_nonfinite": self.nonfinite.enabled}

    def _rewire(self, layout: dict[str, Any]) -> None:
        """A fresh engine over the current default group, with ``layout``'s buckets, keeping local gradients."""
        if layout["reject_nonfinite"] != self.nonfinite.enabled:  # the vote's size would differ: gloo aborts
            raise ValueError(
                f"Rank {self.rank} was built with reject_nonfinite={self.nonfinite.enabled}, the run's members with "
                f"{layout['reject_nonfinite']}: every replica must pass the same value to FaultTolerant."
            )
        ddp, world = self.ddp, membership.world()
        membership.bury(ddp.engine)  # with its buckets and the work handles of its last steps
        ddp.rebuild_engine(world, keep_local_grads=True, caps=tuple(layout["caps"]))  # the comm hook kept
        engine = ddp.engine
        if engine.reduction.hook is not None:
            engine.reduction.state = hook_state.rebind(engine.reduction.state, world)
        engine.adopt_layout(layout["order"], layout["caps"], layout["rebuilt"])
        engine.tolerance.waiter = self.decider.wait
        if self._sharded is not None:
            self._sharded.follow_engine()  # before the first step only: the ranks are the same
        if isinstance(self.divisor, int):
            engine.divisor.fixed = float(self.divisor)
            engine.divisor.reset()
