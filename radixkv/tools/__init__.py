"""Tools around the engine, none of them on a request's path: `replay` (a workload through the
engine, timed as users see it), `simulate` (the cache alone over a trace) and `plot`."""
