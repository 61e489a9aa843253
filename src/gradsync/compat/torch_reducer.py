"""``ddp.reducer``: torch's C++ ``Reducer`` API, as frameworks call it, over gradsync's engine.

Lightning's manual optimization and Accelerate's ``trigger_sync_in_backward`` reach into torch's
reducer by name. This facade translates those names to the engine's lifecycle (engine/reducer.py)
and holds nothing of its own; gradsync's code uses ``ddp.engine`` directly.

=============================  ======================================================
torch's ``Reducer``            gradsync's engine
=============================  ======================================================
``prepare_for_backward(ts)``   ``arm(ts)``: the next backward through ``ts`` reduces
``_rebuild_buckets()``         ``rebuild_once()``: True the one time it rebuilds
``_delay_all_reduce()``        ``finalize_now()``: inside a backward, finalize now
``_ddp_graph_static()``        ``records.graph_static``
``_remove_autograd_hooks()``   ``remove_hooks()``
``_check_reducer_finalized()``  ``check_finalized()``
=============================  ======================================================
"""

from __future__ import annotations

from typing import Any

from ..engine.reducer import Reducer


class TorchReducer:
    __slots__ = ("_engine",)

    def __init__(self, engine: Reducer) -> None:
        self._engine = engine

    def prepare_for_backward(self, tensors: Any) -> None:
        """Expect the next backward through ``tensors`` to reduce (its forward may have run unsynced)."""
        self._engine.arm(tensors)

    def _rebuild_buckets(self) -> bool:
        """Rebuild once after the first synced backward; Lightning calls it before every manual backward."""
        return self._engine.rebuild_once()

    def _delay_all_reduce(self) -> None:
        """torch's first-static-graph-iteration flush: every bucket reduced before this returns.

        gradsync's end-of-backward callback does this by itself; called inside a backward it
        finalizes now, called after one (Lightning's manual optimization) it has nothing left to do.
        """
        self._engine.finalize_now()

    def _ddp_graph_static(self) -> bool:
        """Whether every synced iteration so far left the same parameters unused."""
        return self._engine.records.graph_static

    def _remove_autograd_hooks(self) -> None:
        self._engine.remove_hooks()

    def _check_reducer_finalized(self) -> None:
        self._engine.check_finalized()

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"torch's Reducer.{name} has no counterpart in gradsync's reducer facade (ddp.reducer speaks only "
            "the names frameworks call); gradsync's own engine is ddp.engine."
        )
