"""CFG parallel: the conditional and unconditional passes of classifier-free guidance on two halves of the pool.

The rank with cfg index 0 runs the conditional pass, the rank with cfg index 1 the unconditional one; the two
predictions are exchanged with one all-gather over the cfg group and both ranks combine them identically,
so every rank continues the sampling loop with the same latents. Sampling is otherwise unchanged (the same
step, progress and stop-check calls on every rank).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist

from .sampling import guided_prediction

__all__ = ["cfg_parallel_prediction", "guidance_for"]


def cfg_parallel_prediction(
    model, latents, t, positive, negative, cfg: float, extra: dict, *, group: dist.ProcessGroup | None, index: int
) -> torch.Tensor:
    """``guided_prediction`` with the two passes split over the two ranks of ``group`` (``index`` 0 or 1)."""
    if negative is None:  # cfg == 1: a single conditional pass, run alike on both halves
        return guided_prediction(model, latents, t, positive, None, cfg, extra)
    timestep = t.expand(latents.shape[0]).to(latents.device)
    context = positive if index == 0 else negative
    mine = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=context, return_dict=False, **extra)[0]
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine.contiguous(), group=group)
    conditional, unconditional = both
    return unconditional + cfg * (conditional - unconditional)


def guidance_for(cfg_group: dist.ProcessGroup | None, cfg_degree: int, cfg_index: int) -> Callable:
    """The guided-prediction function a rank samples with: local, or split over its cfg group."""
    if cfg_degree == 1:
        return guided_prediction
    if cfg_degree != 2:
        raise ValueError(f"CFG parallel splits two passes over 2 ranks; got a cfg degree of {cfg_degree}")
    return functools.partial(cfg_parallel_prediction, group=cfg_group, index=cfg_index)
