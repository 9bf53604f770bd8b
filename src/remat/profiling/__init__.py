"""Measuring a model: what each block costs under each treatment, in bytes and seconds.

:mod:`~remat.profiling.profiler` is the entry (``remat.profile``); it fills the records of
:mod:`remat.planning.costs`. Named ``profiling`` so the package never shadows ``remat.profile``.

The private modules (fake tensors, meters, captures, compiled profiles, the measured compiled
step) are this package's own; what the planner and the doctor use of them is named here:
how a plan names its compile scope (:func:`compile_scope`, :func:`profile_scope`, why offload is
never planned compiled: :data:`OFFLOAD_UNDER_COMPILE`), a compiled plan measured on one real step
(:func:`measure_compiled`, :func:`room_to_measure`), the mask a padded batch carries
(:func:`padded_mask`), the memory a measurement may take (:func:`allocator_cap`, :func:`card_bytes`),
and one call's settings (:class:`ProfileRequest`). A fake profile is kept for the next call on the
same model, batch and settings (:mod:`~remat.profiling.reuse`).
Liger's Triton kernels are stood in for on fake tensors (:mod:`~remat.profiling._liger`: shapes,
saved bytes and roofline costs), and ``remat.profile(..., kernels=...)`` measures each block class
with each kernel asked.

Imports run downward: this package uses the head, the treatments, offload and planning, and
never imports :mod:`remat.api`, :mod:`remat.planner` or anything above them (the function that
applies a plan is handed to :func:`measure_compiled` by its caller).
"""
from remat.profiling._compiled import OFFLOAD_UNDER_COMPILE, compile_scope, profile_scope
from remat.profiling._fake import padded_mask
from remat.profiling._request import ProfileRequest
from remat.profiling._room import allocator_cap, card_bytes
from remat.profiling._verify import measure_compiled, room_to_measure

__all__ = ["OFFLOAD_UNDER_COMPILE", "ProfileRequest", "allocator_cap", "card_bytes", "compile_scope", "measure_compiled", "padded_mask",
           "profile_scope", "room_to_measure"]
