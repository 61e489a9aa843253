"""``FaultTolerantDiLoCo``: DiLoCo whose replicas may die and come back, losing no survivor's inner step.

[Note: fault-tolerant DiLoCo]
The run is ``gradsync.elastic``'s: a store (TCPStore or etcd), generations of members agreed in
it, heartbeats on a thread of their own, joiners admitted at a commit. What changes is *when*
the replicas agree: at outer steps only. An inner step is DiLoCo's (the inner optimizer's step
and one integer comparison): no store request, no collective. At an outer step:
1. the outer gradient is averaged over the generation's group and the outer step decided
   together ([Note: an exchange cut off by a death] in committed_exchange.py); an abort forms
   the next generation from the survivors and averages the same outer gradients again;
2. DiLoCo applies the committed average (``theta_global`` and the outer optimizer's state then
   hold the same bits on every replica);
3. joiners the commit admitted (a restarted replica, arrived meanwhile) form the next
   generation with the members and are healed from the first member, by collectives on the new
   group: ``theta_global``, the outer optimizer, DiLoCo's step and fragment schedule (its
   ``state_dict``), the source's model (its local parameters and buffers) and **its inner
   optimizer's state**, ``extra_state``, the counters. A joiner thus starts as a copy of the
   source replica and contributes from the next outer step.
Why the inner optimizer's state is copied rather than started afresh: a fresh AdamW's first
updates are sign-like (``m / sqrt(v)`` is +-1 after bias correction), so a fresh replica's
first outer gradient would be an outlier the average carries into ``theta_global``; the
source's moments were accumulated at the same ``theta_global`` on the same distribution. It is a
copy, not the joiner's own history: the joiner's data from then on is its own.
After every heal the members compare a fingerprint of ``theta_global`` and the outer optimizer's
state (observability/divergence.py); a difference raises.

[Note: error feedback when replicas come and go]
With ``error_feedback=True`` each process holds what its own rounding removed, as sender and as
owner of a piece of the average (diloco/error_feedback.py). They are committed only with an
applied average, so a redo among the survivors starts from the same residuals; over a smaller
group a process owns another piece and keeps only the part of its owner residual that falls in
it, as DiLoCo does when fewer replicas contribute. A joiner starts with none: it has rounded
nothing, and its source's, copied, would send the same delayed components twice. What a dead
replica held is lost with it: at most half a step of each chunk's scale of its last
contribution and of the piece it last owned, beside the whole round of inner steps it loses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..diloco.buffers import check_mode as check_buffers_mode
from ..diloco.exchange import WireCount
from ..diloco.outer import DiLoCo, OuterOptimizerFactory
from ..elastic import heal, membership
from ..elastic.fault_tolerant import HealMismatch
from ..elastic.reconfiguration import Reconfiguration
from ..elastic.run import ElasticRun, current
from ..elastic.step_decision import StepDecider
from ..observability.divergence import fingerprint
from ..wrapper.data_parallel import DataParallelWrapper
from .committed_exchange import CommittedExchange, Outcome, Screening
from .contributions import ContributionScreen, health
from .inner_state import InnerState
from .island_wiring import IslandWiring

logger = logging.getLogger(__name__)


class FaultTolerantDiLoCo:
    """``DiLoCo`` over a ``gradsync.elastic`` run: call ``step()`` where the loop called ``inner_optimizer.step()``.

    Every process is one replica (a plain module). Built after ``elastic.init()``; in a process
    that arrives once the run has started (a restarted replica) the constructor waits until the
    members admit it at an outer step and heals it from one of them ([Note: fault-tolerant DiLoCo]).
    ``extra_state``: objects with ``state_dict``/``load_state_dict`` healed too (an LR scheduler, a
    data position). ``on_reconfigure(rank, world_size, inner_step)`` is called after every change of
    membership, on every member. ``delay``, ``alpha`` and ``merge`` are DiLoCo's (Streaming DiLoCo): a
    fragment's exchange overlaps the next ``delay`` inner steps and is decided at its landing
    ([Note: a death while an exchange is in flight] in committed_exchange.py). ``error_feedback`` is
    DiLoCo's too ([Note: error feedback when replicas come and go]). ``buffers``: as DiLoCo's; with
    ``"average"`` they are averaged inside the decision of the round's last outer step, redone among
    the survivors with it ([Note: buffers in a decided exchange] in committed_exchange.py); a
    replacement is healed with its source's.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int,
        outer_optimizer: OuterOptimizerFactory | None = None,
        fragments: int | Sequence[object] = 1,
        wire: str = "fp32",
        extra_state: dict[str, Any] | None = None,
        on_reconfigure: Callable[[int, int, int], None] | None = None,
        run: ElasticRun | None = None,
        *,
        delay: int = 0,
        alpha: float = 0.5,
        merge: str = "mix",
        error_feedback: bool = False,
        buffers: str = "average",
        max_norm_ratio: float | None = None,
        max_exclusions: int = 3,
    ) -> None:
        island = model if isinstance(model, DataParallelWrapper) else None
        _check_island_options(island, error_feedback)
        check_buffers_mode(buffers)  # before the run is looked up: a mistake named without elastic.init()
        screen = ContributionScreen(max_norm_ratio, max_exclusions)
        self.run = run if run is not None else current()
        self.inner_state = InnerState(inner_optimizer)  # healed whole, or shard by shard (ZeRO inside islands)
        self.wiring = IslandWiring(self.run, island, delay, self.inner_state)  # [Note: an island rewired per ...]
        self.island = island
        # DiLoCo sees the module: the islands, their groups and their DDP are this class's, per generation
        self.outer = DiLoCo(
            island.module if island is not None else model, inner_optimizer, sync_every, outer_optimizer, fragments,
            delay, alpha, wire, merge=merge, error_feedback=error_feedback, buffers=buffers,
            islands_wired_by_caller=island is not None,
        )  # fmt: skip
        self.module = self.outer.module
        self.inner = inner_optimizer
        self.extra_state = dict(extra_state or {})
        self.on_reconfigure = on_reconfigure
        self.outer_steps = 0  # committed outer steps (one fragment's each)
        # the replicas (islands: each named by its first member's uuid, in rank order) the last outer step
        # averaged, and those it left out ([Note: bad contributions are left out] in contributions.py)
        self.contributors: list[str] = []
        self.excluded: list[str] = []
        self.screen = screen
        self.decider = StepDecider(self.run)
        self.membership = Reconfiguration(
            self.run,
            "gradsync.elastic_diloco",
            lambda generation, aborted: self._open_and_heal(generation),
            committed_step=lambda: self.outer_steps,
            describe=lambda: {"outer_steps": self.outer_steps, "inner_step": self.outer.step_count},
            after=self._reconfigured,
        )
        self.exchange = CommittedExchange(
            self.decider,
            self.outer.wire_format,
            lambda: self.outer_steps,
            self._arrivals_known,
            self._change_after_abort,
            overlap=delay > 0,  # [Note: a death while an exchange is in flight] in committed_exchange.py
            buffers=self.outer.buffers,  # [Note: buffers in a decided exchange]
            round_ends=lambda: self.outer.round_ends_at(self.outer.schedule.starting_after(self.outer.step_count)),
            screening=Screening(screen, self._describe, self._islands),
        )
        self.outer.replace_exchange(self.exchange, averages_buffers=True)  # DiLoCo averages through it from now on
        self._rewire()
        if self.run.joining:
            self.membership.join()

    # ------------------------------------------------------------------ the training loop's calls
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The inner step; at an outer step, the decided outer step, then any change of membership."""
        loss = self.outer.step(closure)
        outcome = self.exchange.take_outcome()
        if outcome is not None:
            self._after(outcome)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @property
    def step_count(self) -> int:
        """Inner steps of the run (a healed replica takes its source's)."""
        return self.outer.step_count

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def generation(self) -> int:
        return self.run.generation.number if self.run.generation else -1

    @property
    def members(self) -> list[str]:
        return list(self.run.generation.members) if self.run.generation else []

    @property
    def wire(self) -> WireCount:
        """Bytes this replica sent for the outer exchanges (redone ones included)."""
        return self.exchange.count

    def replicas_identical(self) -> bool:
        """Whether every replica holds the same ``theta_global`` and outer optimizer state, bit for bit
        (the local parameters differ between outer steps by design)."""
        self.exchange.quiet()  # an exchange in flight holds the group until its collectives are over
        every = self._fingerprints()
        return all(torch.equal(theirs, every[0]) for theirs in every)

    @property
    def exchange_in_flight(self) -> bool:
        """Whether a fragment's exchange has started and not landed (with ``delay > 0``)."""
        return self.outer.wire.in_flight > 0

    def close(self) -> None:
        """Leave the run on purpose, after the last step (peers do not take it for dead). An exchange still
        in flight is decided with the others and dropped, as ``DiLoCo.close()`` drops it: end the loop
        after a landing (``exchange_in_flight`` False) to keep the last fragment's inner steps."""
        self.outer.close()
        self.wiring.close()
        self.run.leave()

    @property
    def island_id(self) -> str:
        """This process's replica: the uuid of its island's first member (its own for a plain replica)."""
        generation = self.run.generation
        assert generation is not None, "island_id of a joiner not yet admitted"
        ranks = next(r for r in generation.island_ranks() if generation.rank_of(self.run.uuid) in r)
        return generation.members[ranks[0]]

    # ------------------------------------------------------------------ after an exchange
    def _after(self, outcome: Outcome) -> None:
        run = self.run
        if outcome.revoked is not None:
            logger.warning("gradsync.elastic_diloco: %s while this process was taken for dead; joining again",
                           outcome.revoked)  # fmt: skip
            number = run.member_generation.number
            membership.decline(run.store, run.keys, number + 1, run.uuid)
            run.history.append({"generation": number, "reason": f"revoked: {outcome.revoked}",
                                "revoked": self.outer_steps - 1})  # fmt: skip
            self.decider.forget_vote()
            self.membership.rejoin()
            return
        if outcome.left_out:
            self.membership.rejoin()
            return
        decision = outcome.decision
        assert decision is not None
        self.decider.applied(self.outer_steps, decision, outcome.by_vote)
        self.outer_steps += 1
        run.arrivals_seen = decision.arrivals_seen
        generation = run.member_generation
        ids = [generation.members[ranks[0]] for ranks in generation.island_ranks()]
        left_out = outcome.verdict.excluded if outcome.verdict is not None else []
        self.contributors = [i for n, i in enumerate(ids) if n not in left_out]
        self.excluded = [ids[n] for n in left_out]
        if outcome.verdict is not None and outcome.verdict.excluded:
            self.screen.apply(outcome.verdict, run, self.outer_steps - 1, self.outer.fragments, self.inner_state)
        if decision.admit:
            for joiner in decision.admit:
                run.store.set(run.keys.admitted(joiner), str(generation.number + 1))
            reason = f"admitting {len(decision.admit)} joiner(s)"
            if not self.membership.change(generation.members + decision.admit, generation.members, reason):
                self.membership.rejoin()
        elif not outcome.by_vote:  # settled: the vote failed somewhere, so this generation's group is broken
            if not self.membership.change(generation.members, generation.members, "the commit vote failed"):
                self.membership.rejoin()
        self.decider.wait_for_a_silent_store()

    def _arrivals_known(self) -> int:
        return max(self.run.heartbeat.arrivals_known, self.run.arrivals_seen)

    # ------------------------------------------------------------------ bad contributions
    def _describe(self, delta: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
        """This process's numbers about the outer gradient of the fragment starting now, and its parameters' names."""
        fragment = self.outer.fragments[self._starting_fragment()]
        return health(delta, fragment.sizes, self.inner_state), fragment.names

    def _starting_fragment(self) -> int:
        """The fragment whose exchange starts at this inner step (the exchange asks only at such a step)."""
        step = self.outer.step_count
        starting = self.outer.schedule.starting_after(step)
        if starting is None:
            raise RuntimeError(
                f"FaultTolerantDiLoCo (rank {dist.get_rank()}) was asked to screen an outer gradient after inner step "
                f"{step}, where no fragment's exchange starts: the exchange's start() runs only at DiLoCo's events."
            )
        return starting

    def _islands(self) -> tuple[list[list[int]], list[str]]:
        generation = self.run.member_generation
        return generation.island_ranks(), generation.island_names()

    # ------------------------------------------------------------------ membership changes
    def _change_after_abort(self, reason: str) -> bool:
        """An aborted outer step: the next generation of the live members (False: this process was left out)."""
        members = self.run.member_generation.members
        return self.membership.change(members, members, reason)

    def _reconfigured(self) -> None:
        if self.on_reconfigure is not None:
            self.on_reconfigure(dist.get_rank(), dist.get_world_size(), self.outer.step_count)

    def _open_and_heal(self, generation: membership.Generation) -> None:
        run = self.run
        membership.open_group(run.store, run.keys, generation, run.uuid, run.timeout_s)
        run.generation = generation
        run.heartbeat.watch(generation.members)
        self._rewire()
        if len(generation.healthy) < len(generation.members):  # joiners: the source sends everything
            source = generation.source
            payload = self._payload() if dist.get_rank() == source else None
            device = next(self.module.parameters()).device
            state = heal.transfer(payload, source, membership.world(), device)
            if run.uuid not in generation.healthy:
                self._load(state)
            self._copy_shards(generation, device)
        self._check_identical(generation)

    def _payload(self) -> dict[str, Any]:
        # Healing happens after a landing or while forming a generation at construction: never with an
        # exchange in flight, whose state_dict() would have to decide it here.
        assert not self.exchange_in_flight, "a heal source with an exchange in flight"
        return {
            "outer_steps": self.outer_steps,
            "arrivals_seen": self.run.arrivals_seen,
            "model": self.module.state_dict(),
            "inner": self.inner_state.whole(),  # None with ZeRO: each member's shards travel apart
            "outer": self.outer.state_dict(),
            "extra": {name: obj.state_dict() for name, obj in self.extra_state.items()},
        }

    def _load(self, state: dict[str, Any]) -> None:
        heal.load(self.module, self.inner, {"model": state["model"], "optimizer": state["inner"]})
        self.outer.load_state_dict(state["outer"])
        if self.outer.feedback is not None:
            # Residuals are what this process's own rounding removed: a joiner has rounded nothing, and the
            # source's, copied, would be sent twice ([Note: error feedback when replicas come and go]).
            self.outer.feedback.reset()
        for name, obj in self.extra_state.items():
            obj.load_state_dict(state["extra"][name])
        self.outer_steps = int(state["outer_steps"])
        self.run.arrivals_seen = int(state["arrivals_seen"])

    def _copy_shards(self, generation: membership.Generation, device: torch.device) -> None:
        """With a ShardedOptimizer, each restarted island's members take their shards of the inner optimizer's
        state from the heal source's island, member by member ([Note: shards healed across islands])."""
        if self.inner_state.sharded is None:
            return  # a plain optimizer's state was in the payload
        islands = generation.island_ranks()
        source = next(i for i, ranks in enumerate(islands) if generation.source in ranks)
        members = generation.members
        restarted = [i for i, ranks in enumerate(islands) if members[ranks[0]] not in generation.healthy]
        self.inner_state.copy(islands, source, restarted, device)

    def _check_identical(self, generation: membership.Generation) -> None:
        every = self._fingerprints()
        differ = [rank for rank, theirs in enumerate(every) if not torch.equal(theirs, every[generation.source])]
        if differ:
            raise HealMismatch(
                f"after forming generation {generation.number} (heal source rank {generation.source}), rank(s) "
                f"{differ} hold another theta_global or outer optimizer state."
            )

    def _fingerprints(self) -> list[torch.Tensor]:
        tensors = [theta.detach() for theta in self.outer.global_parameters]
        state = self.outer.outer_optimizer.state_dict()["state"]
        tensors += [t for s in state.values() for t in s.values() if torch.is_tensor(t)]
        mine = fingerprint(tensors)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return every

    def _rewire(self) -> None:
        """DiLoCo's exchange over the current generation (over islands: [Note: an island rewired per generation])."""
        self.outer.topology = self.wiring.topology()
        self.exchange.rebind(self.outer.topology)


def _check_island_options(island: DataParallelWrapper | None, error_feedback: bool) -> None:
    if island is None:
        return
    if error_feedback:
        raise ValueError(
            f"FaultTolerantDiLoCo over islands (rank {dist.get_rank()}) does not take error_feedback=True: each island "
            "member keeps the residuals of its own slice, and the slices change with the islands a generation holds. "
            "Use wire='fp32' (or a rounding wire without feedback) with islands, or plain replicas for error feedback."
        )
