"""Moving saved activations to pinned host memory and back, overlapped with compute.

:mod:`~remat.offload.engine` (the saved-tensor hooks and their bookkeeping),
:mod:`~remat.offload.streams` (copy streams and events, and the CPU stand-in the tests use),
:mod:`~remat.offload.pinned` (the reusable pinned host pool). The memory rule the planner
models the engine by lives in :mod:`remat.planning`, which never imports this package.
"""
