"""An optimizer whose state is sharded over the ranks (gradsync.zero), as the fault-tolerant mode sees it.

[Note: a sharded optimizer under the fault-tolerant mode]
A dead rank's shards of the optimizer state (and, at stage 2, of the step's gradients) exist
nowhere else, so the survivors cannot heal each other or redo the step: when a step does not
commit, they raise the optimizer's ``describe_lost_shards`` (which ranges, which parameters, and
how to resume: the last sharded checkpoint at the smaller world size). Joiners are not admitted
(the shards are laid out over the ranks there are); resume from a sharded checkpoint at the
larger size instead. While nothing fails, the steps commit as with any optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .membership import Generation

if TYPE_CHECKING:  # typing has it from Python 3.10; the package runs on 3.9 (annotations are strings here)
    from typing import TypeGuard


class ShardedState(Protocol):
    """``gradsync.zero.ShardedOptimizer`` as the fault-tolerant wrapper uses it (elastic cannot import zero)."""

    def follow_engine(self) -> None: ...

    def describe_lost_shards(self, dead_ranks: list[int], world_size: int) -> str: ...


def as_sharded(optimizer: object) -> ShardedState | None:
    """``optimizer`` when its state is sharded (it can say which shards a death lost), else None."""
    return optimizer if _is_sharded(optimizer) else None


def _is_sharded(optimizer: object) -> TypeGuard[ShardedState]:
    return hasattr(optimizer, "describe_lost_shards")


def lost_shards_error(
    sharded: ShardedState, candidates: list[str], generation: Generation, reason: str, rank: int, step: int
) -> RuntimeError:
    """What the survivors raise when a step of a sharded optimizer did not commit."""
    dead = [r for r, uuid in enumerate(candidates) if uuid not in generation.members]
    if not dead:
        return RuntimeError(
            f"Rank {rank}: step {step} did not commit ({reason}) although every member is alive; a "
            "ShardedOptimizer's step cannot be redone (its shards hold this step's sums). Restart from the last "
            "sharded checkpoint (gradsync.zero.load_sharded)."
        )
    return RuntimeError(
        f"Rank(s) {dead} of generation {generation.number - 1} died at step {step} ({reason}). "
        + sharded.describe_lost_shards(dead, len(candidates))
    )
