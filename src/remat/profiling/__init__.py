"""Measuring a model: what each block costs under each treatment, in bytes and seconds.

:mod:`~remat.profiling.profiler` is the entry (``remat.profile``); it fills the records of
:mod:`remat.planning.costs`. Named ``profiling`` so the package never shadows ``remat.profile``.
"""
