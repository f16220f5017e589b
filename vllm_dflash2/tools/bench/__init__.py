"""Benchmark tooling: load generators (``load``), worker-side timers and adaptive-state
readers (``profiling``), engine metrics (``metrics``) and a server wrapper (``server``)."""
