"""The reducer's side of the fault-tolerant mode: a step's failures are noted, not raised.

[Note: a step is decided before it is written]
In plain DDP a failed collective raises from ``backward()``. In the fault-tolerant mode
(``gradsync.elastic``) the ranks first agree whether the step commits, and a step that does not
is reduced again over the survivors. That needs every survivor's *local* gradient, so with
``keep_local_grads`` the reducer
- never reduces a gradient in place in ``.grad`` (no lone-gradient shortcut; bucket views are
  refused by the elastic wrapper),
- notes a failed collective in ``failures`` and starts no further collective in that step,
- waits for every bucket but writes nothing: the results wait in ``deferred`` until the step is
  committed, then ``write_deferred`` puts the averages in ``.grad``.
"""

from __future__ import annotations

from typing import Any, Callable

from . import launch
from .agreement import agree_on_used


class TolerantReduction:
    """Mixed into ``Reducer``: what ``keep_local_grads`` changes (see the note above)."""

    def _init_tolerance(self: Any, keep_local_grads: bool) -> None:
        self.keep_local = keep_local_grads
        self.failures: list[str] = []  # collectives that failed in the current step
        self.deferred: tuple[list[Any], list[Any], list[bool] | None, set[int]] | None = None
        # How a bucket is waited for; the elastic wrapper waits in slices, watching its peers.
        self.waiter: Callable[[Any], Any] | None = None
        self.fixed_divisor: float | None = None  # divide by this instead of the group's size
        self.abandoned: list[list[Any]] = []  # work handles of failed steps, never freed

    def _agree_on_used(self: Any) -> list[bool] | None:
        """Which parameters any rank used; None (local use) once the step failed."""
        if self.keep_local and self.failures:
            return None
        try:
            return agree_on_used(
                self._used_since_sync, self.process_group, self.buckets.device, self.desync, self.synced_forwards
            )
        except RuntimeError as error:
            if not self.keep_local:
                raise
            self.failures.append(f"the used-parameter all-reduce failed: {error}")
            return None

    def _wait_and_defer(self: Any, globally_used: list[bool] | None) -> None:
        # Errors of a launch (a dead peer refusing the connection, a hook raising) are failures of
        # this step here: the step is redone over the survivors, or raised if nobody died.
        launch_failures = [e for e in self._errors if isinstance(e, Exception) or " failed on bucket " in e]
        self._errors = [e for e in self._errors if e not in launch_failures]
        self.failures.extend(str(e) for e in launch_failures)
        if not self.failures:
            values, failure = self.buckets.wait_all(self._results, self.hook_name, self.times, self.waiter)
            if failure is not None:
                self.failures.append(failure)
            else:
                self.deferred = (self._results, values, globally_used, set(self._marked_unused))
                return
        # Work handles of a failed step stay referenced with the reducer: freeing one whose gloo
        # pair saw its peer die can end the process (see [Note: forming a generation]).
        self.abandoned.append(self._results)
        self.buckets.begin_iteration()

    def write_deferred(self: Any) -> None:
        """Write the committed step's averages to ``.grad``."""
        if self.deferred is None:
            return
        results, values, used, unused = self.deferred
        self.deferred = None
        problems = self.buckets.write_all(results, values, self.as_view, used, unused, self.hook_name)
        if problems:
            raise RuntimeError("; ".join(problems))

    def drop_step(self: Any) -> None:
        """Forget this step's results and failures (after the ranks agreed on it)."""
        self.deferred = None
        self.failures = []

    def adopt_layout(self: Any, order: list[int], caps: list[int], rebuilt: bool) -> None:
        """Build the buckets another rank has ([Note: a joiner's buckets] in elastic/heal.py)."""
        self.caps = list(caps)
        self.buckets = self.buckets.rebuilt(order, self.caps, self.as_view, not self.keep_local)
        self._rebuild.pending = not rebuilt and self._rebuild.pending
        self._rebuild.done = rebuilt
        self._reset_iteration()

    def reduce_again(self: Any) -> None:
        """Reduce the local gradients again, over this reducer's (new) group; results deferred.

        The survivors' redo of a step that did not commit: every bucket is started as backward
        would, from ``.grad`` (kept local by ``keep_local_grads``); a parameter without a gradient
        contributes zeros.
        """
        self._reset_iteration()
        self.failures = []
        for b, storage in enumerate(self.buckets.storages):
            if storage.sparse:
                pending = launch.start_sparse(
                    self.buckets, b, self._take_divisor, self.process_group, self.comm_hook, self.comm_hook_state
                )
                self._results.append(pending)
            else:
                self._launch_dense(b)
        launch.finish_hook_launches(self.comm_hook_state)
        self._wait_and_defer(None)
        self._results = []

    def layout(self: Any) -> dict[str, Any]:
        """What ``adopt_layout`` needs to build these buckets on another rank."""
        return {"order": list(self.buckets.order), "caps": list(self.caps), "rebuilt": self._rebuild.done}
