"""Tools around the runtime, never imported by it: the offline evaluation, benchmark
drivers (``bench``), what a measurement depends on (``machine``: default dtype, CPU flags,
benchmark environment) and tiny random models. Tools may import ``train``, never the
reverse."""
