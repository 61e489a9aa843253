"""torch's vocabulary over gradsync's objects: the private names frameworks call, torch's logging data."""
