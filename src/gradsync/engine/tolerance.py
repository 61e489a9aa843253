"""The fault-tolerant mode's side of the reducer: a step's failures are noted, not raised.

[Note: a step is decided before it is written]
In plain DDP a failed collective raises from ``backward()``. In the fault-tolerant mode
(``gradsync.elastic``) the ranks first agree whether the step commits, and a step that does not
is reduced again over the survivors (or, with ``reject_nonfinite``, without the ranks whose
gradients are not finite: [Note: non-finite gradients] in elastic/nonfinite.py). That needs every
survivor's *local* gradient, so with ``keep_local_grads`` the reducer
- never reduces a gradient in place in ``.grad`` (no lone-gradient shortcut; bucket views are
  refused by the elastic wrapper),
- notes a failed collective in ``failures`` and starts no further collective in that step,
- waits for every bucket but writes nothing: the results wait in ``deferred`` until the step is
  committed, then ``write_deferred`` puts the averages in ``.grad``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from .backward_pass import BackwardPass
from .bucket_set import BucketSet


class DeferredStep(NamedTuple):
    """A backward's results, waited for but not yet written to ``.grad``."""

    launched: list[Any]
    values: list[Any]
    globally_used: list[bool] | None
    unused: set[int]


class Tolerance:
    """Off in plain DDP (``note`` returns False, the caller raises); on with ``keep_local_grads``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.failures: list[str] = []  # collectives that failed in the current step
        self.deferred: DeferredStep | None = None
        # How a bucket is waited for; the elastic wrapper waits in slices, watching its peers.
        self.waiter: Callable[[Any], Any] | None = None
        self.abandoned: list[list[Any]] = []  # work handles of failed steps, never freed

    def note(self, failure: str) -> bool:
        """Record a failed collective of this step; False in plain DDP, where the caller raises."""
        if not self.enabled:
            return False
        self.failures.append(failure)
        return True

    def wait_and_defer(
        self, buckets: BucketSet, current: BackwardPass, hook_name: str | None, globally_used: list[bool] | None
    ) -> None:
        """Wait for every bucket of ``current`` and keep the results for ``write_deferred``."""
        self.take_launch_failures(current)
        if not self.failures:
            values, failure = buckets.wait_all(current.launched, hook_name, current.times, self.waiter)
            if failure is not None:
                self.failures.append(failure)
            else:
                self.deferred = DeferredStep(current.launched, values, globally_used, set(current.marked_unused))
                return
        self.abandon(current.launched, buckets)

    def take_launch_failures(self, current: BackwardPass) -> None:
        """Errors of a launch (a dead peer refusing the connection, a hook raising) are failures of
        this step here: the step is redone over the survivors, or raised if nobody died."""
        launch_failures = [e for e in current.errors if isinstance(e, Exception) or " failed on bucket " in e]
        current.errors = [e for e in current.errors if e not in launch_failures]
        self.failures.extend(str(e) for e in launch_failures)

    def abandon(self, launched: list[Any], buckets: BucketSet) -> None:
        """Work handles of a failed step stay referenced: freeing one whose gloo pair saw its peer
        die can end the process (see [Note: forming a generation] in elastic/membership.py)."""
        self.abandoned.append(launched)
        buckets.begin_iteration()

    def write_deferred(self, buckets: BucketSet, as_view: bool, hook_name: str | None) -> None:
        """Write the committed step's averages to ``.grad``."""
        if self.deferred is None:
            return
        step, self.deferred = self.deferred, None
        problems = buckets.write_all(step.launched, step.values, as_view, step.globally_used, step.unused, hook_name)
        if problems:
            raise RuntimeError("; ".join(problems))

    def drop_step(self) -> None:
        """Forget this step's results and failures (after the ranks agreed on it)."""
        self.deferred = None
        self.failures = []
