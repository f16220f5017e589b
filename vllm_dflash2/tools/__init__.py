"""Tools around the runtime, never imported by it: the default target's assets, the
offline evaluation, benchmark drivers (``bench``), what a measurement depends on
(``machine``: default dtype, CPU flags, benchmark environment) and tiny random models."""
