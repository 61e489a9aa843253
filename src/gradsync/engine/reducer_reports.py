"""How a reducer tells what went wrong in a backward, and records what each iteration did.

Mixed into ``Reducer`` (reducer.py), which holds the state these read.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..observability.liveness import roll_call
from ..observability.timing import now
from . import errors


class ReducerReports:
    """Error raising and per-iteration records of ``Reducer``."""

    def _raise_errors(self: Any) -> None:
        """Raise what went wrong in this backward: a comm hook's own exception first, as itself."""
        exceptions = [e for e in self._errors if isinstance(e, BaseException)]
        messages = list(dict.fromkeys(e for e in self._errors if isinstance(e, str)))
        if exceptions:
            error = exceptions[0]
            for message in messages:
                errors.add_note(error, message)
            self.last_error = str(error)
            raise error
        message = "; ".join(messages)
        if any(" failed on bucket " in e for e in messages):
            message = self.collective_failure_message(message, iteration=self.iteration - 1)
        self.last_error = message
        raise RuntimeError(message)

    def collective_failure_message(self: Any, detail: str, iteration: int | None = None) -> str:
        """Where this rank was when a collective failed, and which ranks are gone."""
        iteration = self.iteration if iteration is None else iteration
        where = f"{self.phase} of iteration {iteration}"
        return f"Rank {self.rank}: a collective failed during {where}: {detail}. {roll_call(where)}"

    def _record_iteration(self: Any) -> None:
        times = self.times
        times.finalize_end = now()
        unused_indices = tuple(sorted(self._marked_unused))
        if self._last_unused is not None and unused_indices != self._last_unused:
            self.graph_static = False
        self._last_unused = unused_indices
        unused = tuple(self.names[i] for i in unused_indices)
        self.running.add(times, self.buckets.nbytes, unused)
        if self.timeline is not None:
            self.timeline.add_iteration(self.iteration, times, [s.nbytes for s in self.buckets.storages])
        if self.find_unused and not unused and not self._warned_nothing_unused and not self.static_graph:
            self._warned_nothing_unused = True
            warnings.warn(errors.nothing_unused(self.rank, self.iteration), UserWarning, stacklevel=2)

    def _twice_error(self: Any, index: int) -> str:
        return errors.gradient_in_pieces(self.names[index], self.rank, self.iteration)

    def _static_graph_error(self: Any, index: int) -> str:
        return self._static.changed_error(self.names[index], index, self.rank, self.iteration)
