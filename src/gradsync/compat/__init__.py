"""torch's vocabulary over gradsync's objects: ``ddp.reducer`` (torch_reducer), torch's logging data,
and torch internals without a counterpart. ``gradsync.ddp`` is where these meet the wrapper."""
