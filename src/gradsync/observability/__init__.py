"""What the engine reports and checks: timings and ``ddp.stats()``, the trace timeline, profiler
labels, divergence and desync detection, and the roll call that names a dead rank."""
