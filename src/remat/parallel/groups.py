"""The process group of the context-parallel ranks: which one this process is, and how many.

Its own module because both the sharding of a batch (:mod:`remat.parallel.sequence`) and the
attention exchange (:mod:`remat.parallel.attention`) ask it, and the attention imports the sharding's
checks: here neither imports the other to learn its rank.
"""
from __future__ import annotations

import torch.distributed as dist


def rank_and_world(group=None) -> tuple:
    """This process's rank and the world size of ``group``.

    Args:
        group: a ProcessGroup, a 1-D DeviceMesh (``mesh["cp"]``) or None (the default group).

    Returns:
        ``(rank, world)``.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: a mesh of more than one dimension."""
    pg = process_group(group)
    return dist.get_rank(pg), dist.get_world_size(pg)


def process_group(group=None):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context parallelism needs torch.distributed initialised (torch.distributed."
                           "init_process_group, e.g. under torchrun)")
    if group is None:
        return dist.group.WORLD
    if hasattr(group, "get_group") and hasattr(group, "ndim"):  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"pass the context-parallel dimension of the mesh (mesh['cp']), a 1-D mesh, got a "
                             f"{group.ndim}-D mesh")
        return group.get_group()
    return group
