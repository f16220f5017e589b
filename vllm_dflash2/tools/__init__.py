"""Tools around the runtime, never imported by it: the default target's assets, the
offline evaluation, benchmark drivers (``bench``) and tiny random models."""
