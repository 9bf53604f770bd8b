"""Moving saved activations to pinned host memory and back, overlapped with compute.

:mod:`~remat.offload.engine` (the saved-tensor hooks, the forward's copies, the settings and stats),
:mod:`~remat.offload.backward` (unpack, fetch back, release),
:mod:`~remat.offload.records` (records, slots, packed handles, and what is never moved),
:mod:`~remat.offload.streams` (copy streams and events, and the CPU stand-in the tests use),
:mod:`~remat.offload.pinned` (the reusable pinned host pool). The memory rule the planner
models the engine by lives in :mod:`remat.planning`, which never imports this package.
"""
