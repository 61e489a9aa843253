"""What the user set on a wrapper's engine, given to every engine the wrapper builds.

[Note: what a rebuilt engine keeps]
The wrapper builds its engine (engine/reducer.py) anew on ``_set_static_graph()``,
``_update_process_group()`` and the fault-tolerant mode's rewiring: buckets, records and hooks start
from scratch. What the user switched on must not go with the old engine: the fused optimizer
(``_register_fused_optim``), the desync detector (``GRADSYNC_DEBUG=desync``), a ``gradsync.trace`` in
progress, and the comm hook with the bucket caps it prefers ([Note: caps under a compressing hook] in
bucket_caps.py). Until 2026-12-04 a rebuilt engine silently lost all but the fused optimizer and the
hook; now every engine is built through ``EngineSettings.apply``, the one place that lists them.
"""

from __future__ import annotations

from ..engine.fused_optim import FusedOptimizer
from ..engine.reducer import Reducer
from ..observability.trace import Timeline
from .agreement_checks import AgreementChecks
from .bucket_caps import one_bucket_caps, prefers_few_buckets


class EngineSettings:
    """The settings of one wrapper's engine that outlive the engine."""

    def __init__(self, checks: AgreementChecks, default_caps_on_cpu: bool) -> None:
        self.checks: AgreementChecks | None = checks  # its desync detector, when switched on
        self.fused_optimizer: FusedOptimizer | None = None
        self.timeline: Timeline | None = None  # where gradsync.trace collects
        self.default_caps_on_cpu = default_caps_on_cpu  # the caps are the default's (not the user's), on a CPU

    def __getstate__(self) -> dict[str, object]:
        """Pickled with the wrapper: the checks and the trace are per process (the checks are off on load;
        the unpickling wrapper hands its own in)."""
        return {**self.__dict__, "checks": None, "timeline": None}

    def apply(self, engine: Reducer, previous: Reducer | None = None) -> Reducer:
        """``engine`` with every setting, and ``previous``'s comm hook (with its caps) if it had one."""
        engine.fused_optimizer = self.fused_optimizer
        engine.desync = None if self.checks is None else self.checks.desync
        engine.records.timeline = self.timeline
        hooked = None if previous is None else previous.reduction
        if hooked is not None and hooked.hook is not None:
            engine.register_comm_hook(hooked.state, hooked.hook)
            self.caps_for_hook(engine, hooked.state)
        return engine

    def caps_for_hook(self, engine: Reducer, state: object) -> None:
        """[Note: caps under a compressing hook]: the default's caps on a CPU become one bucket under a
        hook that sends little; the rebuild after iteration 0 uses them."""
        if self.default_caps_on_cpu and prefers_few_buckets(state):
            engine.layout.caps = one_bucket_caps()
