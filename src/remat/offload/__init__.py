"""Moving saved activations to pinned host memory and back, overlapped with compute.

:mod:`~remat.offload.engine` (the saved-tensor hooks, the forward's copies, the settings and stats),
:mod:`~remat.offload.backward` (unpack, fetch back, release),
:mod:`~remat.offload.records` (records, slots, packed handles, and what is never moved),
:mod:`~remat.offload.streams` (copy streams and events, and the CPU stand-in the tests use),
:mod:`~remat.offload.pinned` (the reusable pinned host pool). The memory rule the planner
models the engine by lives in :mod:`remat.planning`, which never imports this package.

Other packages use what is named here: the engine, its settings the planner models
(:data:`DEFAULT_MIN_BYTES`, :data:`DEFAULT_WINDOW_RECORDS`, :data:`ISSUE_WINDOW`), and the host
memory the pinned pool may take (:data:`HOST_FRACTION`, :func:`host_memory`, :func:`default_limit`).
This package imports torch and nothing else of remat.
"""
from remat.offload.engine import DEFAULT_MIN_BYTES, DEFAULT_WINDOW_RECORDS, ISSUE_WINDOW, OffloadEngine
from remat.offload.pinned import HOST_FRACTION, default_limit, host_memory

__all__ = ["DEFAULT_MIN_BYTES", "DEFAULT_WINDOW_RECORDS", "HOST_FRACTION", "ISSUE_WINDOW", "OffloadEngine",
           "default_limit", "host_memory"]
