"""Classifier-free guidance, written once: the local two-pass form and the CFG-parallel form; runs in the workers.

With CFG parallel the rank with cfg index 0 runs the conditional pass and the rank with cfg index 1 the
unconditional one; the two predictions are exchanged with one all-gather over the cfg group and both ranks
combine them with the same ``combine_guidance``, so every rank continues the sampling loop with the same
latents. Sampling is otherwise unchanged (the same step, progress and stop-check calls on every rank).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["IMAGE_CONCAT", "combine_guidance", "flow_prediction", "guided_prediction", "cfg_parallel_prediction", "guidance_for"]


def combine_guidance(conditional: torch.Tensor, unconditional: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    return unconditional + guidance_scale * (conditional - unconditional)


IMAGE_CONCAT = "image_concat"  # the ``extra`` entry whose channels are concatenated to the latents (image-to-video)


def flow_prediction(model, latents, t, context, extra: dict) -> torch.Tensor:
    """One model call: the flow prediction of ``latents`` at timestep ``t`` (one value, or one per row). ``extra``
    holds further model inputs; its ``IMAGE_CONCAT`` entry is concatenated to the latents' channels, as native
    Wan feeds image-to-video models."""
    timestep = t.expand(latents.shape[0]).to(latents.device)
    kwargs = {name: value for name, value in extra.items() if name != IMAGE_CONCAT}
    if extra.get(IMAGE_CONCAT) is not None:
        latents = torch.cat([latents, extra[IMAGE_CONCAT].to(latents.dtype)], dim=1)
    return model(hidden_states=latents, timestep=timestep, encoder_hidden_states=context, return_dict=False, **kwargs)[0]


def guided_prediction(model, latents, t, positive, negative, guidance_scale: float, extra: dict) -> torch.Tensor:
    """One classifier-free-guided flow prediction (a single pass when there is no negative context)."""
    conditional = flow_prediction(model, latents, t, positive, extra)
    if negative is None:
        return conditional
    return combine_guidance(conditional, flow_prediction(model, latents, t, negative, extra), guidance_scale)


def cfg_parallel_prediction(
    model, latents, t, positive, negative, guidance_scale: float, extra: dict, *,
    group: dist.ProcessGroup | None, index: int,
) -> torch.Tensor:
    """``guided_prediction`` with the two passes split over the two ranks of ``group`` (``index`` 0 or 1)."""
    if negative is None:  # guidance scale 1: a single conditional pass, run alike on both halves
        return guided_prediction(model, latents, t, positive, None, guidance_scale, extra)
    mine = flow_prediction(model, latents, t, positive if index == 0 else negative, extra)
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine.contiguous(), group=group)
    return combine_guidance(both[0], both[1], guidance_scale)


def guidance_for(cfg_group: dist.ProcessGroup | None, cfg_degree: int, cfg_index: int) -> Callable:
    """The guided-prediction function a rank samples with: local, or split over its cfg group."""
    if cfg_degree == 1:
        return guided_prediction
    if cfg_degree != 2:
        raise ValueError(f"CFG parallel splits two passes over 2 ranks; got a cfg degree of {cfg_degree}")
    return functools.partial(cfg_parallel_prediction, group=cfg_group, index=cfg_index)
