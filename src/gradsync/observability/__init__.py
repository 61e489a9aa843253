"""What the engine reports and checks: timings and ``ddp.stats()`` (from CUDA events on a GPU), the
trace timeline, profiler labels, divergence and desync detection, and the roll call that names a dead rank."""
