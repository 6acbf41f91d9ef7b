"""Process-group arithmetic shared by every parallel plan; runs in the workers (and benchmark ranks)."""

from __future__ import annotations

import torch.distributed as dist


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(size, this process's index) in ``group``; (1, 0) when torch.distributed is not initialised.

    ``None`` follows torch's convention: the default (world) group when a process group is initialised.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 1, 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return dist.get_world_size(group), rank


def optional_group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """Like :func:`group_size_and_rank`, but ``None`` means "not split along this dimension": (1, 0)."""
    return (1, 0) if group is None else group_size_and_rank(group)
