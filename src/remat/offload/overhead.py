"""Transitional: the engine's GPU memory rule moved to :mod:`remat.planning.offload_model`.

:mod:`remat.offload.engine` still imports ``DEFAULT_WINDOW_RECORDS`` and ``gpu_overhead_bytes``
from here; once it defines its own ``DEFAULT_WINDOW_RECORDS`` and its callers import
``gpu_overhead_bytes`` from :mod:`remat.planning.offload_model`, this module is deleted.
"""
from remat.planning.offload_model import DEFAULT_WINDOW_RECORDS, gpu_overhead_bytes  # noqa: F401
