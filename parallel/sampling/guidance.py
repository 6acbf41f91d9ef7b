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

__all__ = ["IMAGE_CONCAT", "PASS_INPUTS", "TIME_CONCAT", "combine_guidance", "flow_prediction", "guided_prediction", "cfg_parallel_prediction", "guidance_for",
           "token_timesteps"]


def combine_guidance(conditional: torch.Tensor, unconditional: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    return unconditional + guidance_scale * (conditional - unconditional)


IMAGE_CONCAT = "image_concat"  # the ``extra`` entry whose channels are concatenated to the latents (image-to-video)
TIME_CONCAT = "time_concat"  # the ``extra`` entry whose frames follow the latents' (ComfyUI's time_dim_concat)
PASS_INPUTS = "pass_inputs"  # the ``extra`` entry (conditional pass's inputs, unconditional pass's) of inputs that
# differ between the guidance passes; each pass's are merged into the others for its call


def pass_inputs(extra: dict, index: int) -> dict:
    """The model inputs of guidance pass ``index`` (0 conditional, 1 unconditional)."""
    per_pass = extra.get(PASS_INPUTS)
    if per_pass is None:
        return extra
    return {**{name: value for name, value in extra.items() if name != PASS_INPUTS}, **per_pass[index]}


DEFAULT_PATCH = (1, 2, 2)  # Wan's patch size: test doubles without a config


def token_timesteps(frame_timesteps: torch.Tensor, latent_shape: tuple, patch: tuple) -> torch.Tensor:
    """Per-frame timesteps [B, T] as diffusers' Wan transformer takes them: one per token [B, tokens], each latent
    frame's value repeated over that frame's tokens (the patch grid of the size the model pads to), as native
    Wan's ``repeat_e`` spreads per-frame modulation. Wan's patches are one frame deep."""
    if patch[0] != 1:
        raise ValueError(f"per-frame timesteps need patches one frame deep; this model's patch is {tuple(patch)}")
    height, width = latent_shape[-2:]
    per_frame = -(-height // patch[1]) * -(-width // patch[2])
    return frame_timesteps.repeat_interleave(per_frame, dim=1)


def model_timestep(model, t: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """The timestep argument of one call: one value per row, or, for per-frame timesteps [B, T], one per token."""
    if t.ndim < 2:
        return t.expand(latents.shape[0]).to(latents.device)
    patch = tuple(getattr(getattr(model, "config", None), "patch_size", DEFAULT_PATCH))
    return token_timesteps(t, tuple(latents.shape), patch).to(latents.device)


def flow_prediction(model, latents, t, context, extra: dict) -> torch.Tensor:
    """One model call: the flow prediction of ``latents`` at timestep ``t`` (one value, one per row, or one per row
    and latent frame [B, T]: Wan 2.2's noise mask). ``extra`` holds further model inputs; its ``IMAGE_CONCAT``
    entry is concatenated to the latents' channels, as native Wan feeds image-to-video models, and its
    ``TIME_CONCAT`` entry to their frames (native Wan's ``time_dim_concat``: the model, its RoPE and the sequence
    split of ring / Ulysses run the longer video, the prediction keeps the sampled frames)."""
    timestep = model_timestep(model, t, latents)
    kwargs = {name: value for name, value in extra.items() if name not in (IMAGE_CONCAT, TIME_CONCAT, PASS_INPUTS)}
    frames = latents.shape[2]
    if extra.get(IMAGE_CONCAT) is not None:
        latents = torch.cat([latents, extra[IMAGE_CONCAT].to(latents.dtype)], dim=1)
    if extra.get(TIME_CONCAT) is not None:  # the model runs the longer video; the sampled frames' prediction is kept
        latents = torch.cat([latents, extra[TIME_CONCAT].to(latents.dtype)], dim=2)
    prediction = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=context, return_dict=False,
                       **kwargs)[0]
    return prediction[:, :, :frames]


def guided_prediction(model, latents, t, positive, negative, guidance_scale: float, extra: dict) -> torch.Tensor:
    """One classifier-free-guided flow prediction (a single pass when there is no negative context)."""
    conditional = flow_prediction(model, latents, t, positive, pass_inputs(extra, 0))
    if negative is None:
        return conditional
    unconditional = flow_prediction(model, latents, t, negative, pass_inputs(extra, 1))
    return combine_guidance(conditional, unconditional, guidance_scale)


def cfg_parallel_prediction(
    model, latents, t, positive, negative, guidance_scale: float, extra: dict, *,
    group: dist.ProcessGroup | None, index: int,
) -> torch.Tensor:
    """``guided_prediction`` with the two passes split over the two ranks of ``group`` (``index`` 0 or 1)."""
    if negative is None:  # guidance scale 1: a single conditional pass, run alike on both halves
        return guided_prediction(model, latents, t, positive, None, guidance_scale, extra)
    mine = flow_prediction(model, latents, t, positive if index == 0 else negative, pass_inputs(extra, index))
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
