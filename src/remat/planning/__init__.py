"""Numbers in, plan out: plans and specs, the per-block records a plan resolves into (what
:mod:`remat.treat` applies: :mod:`~remat.planning.records`), cost records, the step's block calls (a
block run several times a step: :mod:`~remat.planning.calls`), the choice of kernels per block class
(:mod:`~remat.planning.kernels`), the step simulator, the solver.

Pure: nothing here walks a model or imports :mod:`remat.treat`, :mod:`remat.offload` or
:mod:`remat.profiling` (a test checks it), so plans for a cluster are made on a laptop.
"""
