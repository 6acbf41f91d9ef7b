"""One transformer call for a sampler that runs in the driver's process; runs in the workers.

ComfyUI's own samplers (KSampler and the rest) drive the WanMesh MODEL: they own the schedule, the noise and the
guidance, and each of their model calls becomes one ``protocol.ModelForward``. Here a rank turns its share of the
rows (model input, timestep, text, VACE context) into flow predictions with the resident transformer and its
parallel plans, exactly as the worker-side loop calls the model.
"""

from __future__ import annotations

import contextlib

import torch

from ..networks.reference import REFERENCE_KEYWORD
from ..protocol import ModelForward
from ..vace.context import default_vace_context
from ..config import LATENT_CHANNELS, WAN22_LATENT_CHANNELS
from .guidance import IMAGE_CONCAT, flow_prediction
from .latents import LATENTS_MEAN, LATENTS_STD


def vace_call_inputs(contexts: torch.Tensor, strengths: list[float], layer_count: int, dtype, device) -> dict:
    """The keyword arguments that feed normalised VACE contexts [B, N, 96, T, h, w] to diffusers' VACE transformer:
    one context takes its single-context form (one scale per VACE layer), several the multi-context form."""
    contexts = contexts.to(device=device, dtype=dtype)
    if len(strengths) == 1:
        scale = torch.full((layer_count,), float(strengths[0]), device=device, dtype=dtype)
        return {"control_hidden_states": contexts[:, 0], "control_hidden_states_scale": scale}
    return {"control_hidden_states": contexts,
            "control_hidden_states_scale": torch.tensor([float(s) for s in strengths], device=device, dtype=dtype)}


def vace_layers_of(model, given_contexts: bool) -> list[int] | None:
    """The model's VACE layers; None for a model without VACE blocks, which refuses VACE contexts."""
    vace_layers = getattr(getattr(model, "config", None), "vace_layers", None)
    if vace_layers is None and given_contexts:
        raise ValueError("the conditioning carries VACE contexts but the model has no VACE blocks; load a VACE model "
                         "(or a T2V model with a VACE module), or sample without VACE conditioning")
    return vace_layers


def forward_vace_inputs(model, request: ModelForward, rows: range, dtype, device) -> dict:
    """VACE inputs of a model call: the given contexts, or the native default (zero latents, ones mask) for a VACE
    model called without them; none for a model without VACE blocks (which refuses VACE contexts)."""
    vace_layers = vace_layers_of(model, request.vace_context is not None)
    if vace_layers is None:
        return {}
    if request.vace_context is None:
        _, _, frames, h, w = request.latent.shape
        contexts = default_vace_context(len(rows), frames, h, w, LATENTS_MEAN.flatten(), LATENTS_STD.flatten())
        return vace_call_inputs(contexts, [1.0], len(vace_layers), dtype, device)
    contexts = request.vace_context[rows.start : rows.stop]
    return vace_call_inputs(contexts, request.vace_strengths, len(vace_layers), dtype, device)


def latent_channels(model) -> int:
    """The channels of the latents a transformer samples (its output): 16 (Wan 2.1 VAE) or 48 (Wan 2.2 TI2V 5B)."""
    return getattr(getattr(model, "config", None), "out_channels", LATENT_CHANNELS)


def check_latent_for_model(model, channels: int) -> None:
    """The latent's channels are the model's: a Wan 2.2 VAE latent (48) for TI2V 5B, a Wan 2.1 one (16) else."""
    expected = latent_channels(model)
    if channels != expected:
        raise ValueError(f"the latent has {channels} channels but this model samples {expected}-channel latents; "
                         f"use the latent made for it ({WAN22_LATENT_CHANNELS}: Wan 2.2 TI2V 5B with the Wan 2.2 VAE, "
                         f"e.g. Wan22ImageToVideoLatent; {LATENT_CHANNELS}: every other Wan model)")


def image_inputs(model, image_concat: torch.Tensor | None, clip_fea: torch.Tensor | None, rows: range,
                 latent_shape: tuple, dtype, device) -> dict:
    """The image-to-video inputs of the given rows: the image channels concatenated to the latents (zeros when
    none are given, as native Wan fills them) and the CLIP vision tokens of models that take them. A model
    without image inputs refuses image channels."""
    return {**image_concat_input(model, image_concat, rows, latent_shape, dtype, device),
            **image_token_inputs(model, clip_fea, rows, latent_shape[0], dtype, device)}


def image_concat_input(model, image_concat: torch.Tensor | None, rows: range, latent_shape: tuple, dtype,
                       device) -> dict:
    """The ``IMAGE_CONCAT`` entry of an image-to-video model (its given rows, or zeros); none for other models,
    which refuse image channels."""
    config = getattr(model, "config", None)  # test doubles and wrappers may have none: a text-to-video model
    extra_channels = getattr(config, "in_channels", LATENT_CHANNELS) - latent_channels(model)
    if image_concat is not None and not extra_channels:
        raise ValueError("the conditioning carries a start image but this model is not an image-to-video model; load "
                         "a Wan I2V model, or sample without the image conditioning")
    if not extra_channels:
        return {}
    if image_concat is None:
        image_concat = torch.zeros(1, extra_channels, *latent_shape[2:])
    return {IMAGE_CONCAT: _batch_rows(image_concat, rows, latent_shape[0]).to(device=device, dtype=dtype)}


def image_token_inputs(model, clip_fea: torch.Tensor | None, rows: range, batch: int, dtype, device) -> dict:
    """The CLIP vision tokens of the given rows for a model that takes them (Wan 2.1 I2V / FLF2V); none for other
    models (native ignores tokens they cannot take) and none when none are given (the model then attends to the
    text in their place, as native: ``networks/wan_inputs.py``)."""
    if clip_fea is None or not getattr(getattr(model, "config", None), "image_dim", None):
        return {}
    return {"encoder_hidden_states_image": _batch_rows(clip_fea, rows, batch).to(device=device, dtype=dtype)}


def animate_inputs(model, pose_latents: torch.Tensor | None, face_pixels: torch.Tensor | None, rows: range,
                   batch: int, dtype, device) -> dict:
    """Wan 2.2 Animate's pose latents and face video of the given rows (``networks/wan_animate.py``); a model
    without the face adapter refuses them."""
    given = {name: tensor for name, tensor in (("pose_latents", pose_latents), ("face_pixel_values", face_pixels))
             if tensor is not None}
    if given and getattr(model, "face_adapter", None) is None:
        raise ValueError("the conditioning carries a pose or face video (WanAnimateToVideo) but this model is not "
                         "Wan 2.2 Animate; load a Wan 2.2 Animate model, or sample without that conditioning")
    return {name: _batch_rows(tensor, rows, batch).to(device=device, dtype=dtype) for name, tensor in given.items()}


CAMERA_CONDITIONS = "camera_conditions"  # the Fun Camera transformer's forward argument (networks/wan_camera.py)


def camera_inputs(model, camera: torch.Tensor | None, rows: range, batch: int, dtype, device) -> dict:
    """The Fun Camera embedding of the given rows (one row given stays one: the adapter's output broadcasts); none
    without one. A model without a camera adapter refuses it."""
    if camera is None:
        return {}
    if not getattr(getattr(model, "config", None), "camera_in_channels", None):
        raise ValueError("the conditioning carries camera_conditions (WanCameraImageToVideo) but this model has no "
                         "camera adapter; load a Wan 2.1 Fun Camera model, or sample without the camera embedding")
    camera = camera if camera.shape[0] == 1 else camera[rows.start : rows.stop]
    return {CAMERA_CONDITIONS: camera.to(device=device, dtype=dtype)}


def audio_inputs(model, audio_embed: torch.Tensor | None, rows: range, batch: int, dtype, device) -> dict:
    """HuMo's audio windows of the given rows (``networks/wan_humo.py``); a model without the audio parts refuses
    them."""
    if audio_embed is None:
        return {}
    if getattr(model, "audio_proj", None) is None:
        raise ValueError("the conditioning carries audio_embed (WanHuMoImageToVideo) but this model is not HuMo; load "
                         "a HuMo model, or sample without that conditioning")
    return {"audio_embed": _batch_rows(audio_embed, rows, batch).to(device=device, dtype=dtype)}


def _batch_rows(tensor: torch.Tensor, rows: range, batch: int) -> torch.Tensor:
    """The given rows of a tensor that holds one row for every batch row, or one for all of them."""
    if tensor.shape[0] == 1 and batch != 1:
        return tensor.expand(batch, *tensor.shape[1:])[rows.start : rows.stop]
    return tensor[rows.start : rows.stop]


def forward_rows(model, request: ModelForward, rows: range, dtype, device) -> torch.Tensor:
    """The flow prediction [len(rows), 16 or 48, T, h, w] (float32, CPU) of the given rows of a model call; an
    image-to-video model's input arrives with its image channels already concatenated (36 channels), per-frame
    timesteps [B, T] (Wan 2.2 with a noise mask) are spread over each frame's tokens."""
    latents = request.latent[rows.start : rows.stop].to(device=device, dtype=dtype)
    timestep = request.timestep[rows.start : rows.stop].to(device)
    context = request.context[rows.start : rows.stop].to(device=device, dtype=dtype)
    extra = forward_vace_inputs(model, request, rows, dtype, device)
    in_channels = getattr(model.config, "in_channels", LATENT_CHANNELS)
    if latents.shape[1] != in_channels:
        raise ValueError(f"the model call gives {latents.shape[1]} input channels but this model takes "
                         f"{in_channels}; use image-to-video conditioning with image-to-video models only, and the "
                         "latent made for the model (48 channels: Wan 2.2 TI2V 5B only)")
    # the input holds its image channels already: only the CLIP vision tokens (and a Fun reference) are added
    extra.update(image_token_inputs(model, request.clip_fea, rows, request.latent.shape[0], dtype, device))
    if request.reference_latent is not None:
        extra[REFERENCE_KEYWORD] = request.reference_latent[rows.start : rows.stop].to(device=device, dtype=dtype)
    extra.update(animate_inputs(model, request.pose_latents, request.face_pixels, rows, request.latent.shape[0],
                                dtype, device))
    extra.update(camera_inputs(model, request.camera_conditions, rows, request.latent.shape[0], dtype, device))
    extra.update(audio_inputs(model, request.audio_embed, rows, request.latent.shape[0], dtype, device))
    with skipping_blocks(model, request.skip_blocks):
        return flow_prediction(model, latents, timestep, context, extra).float().cpu()


def _skipped_block_forward(hidden_states, *args, **kwargs):
    return hidden_states  # a skipped block's output is its input, as ComfyUI's skip-layer replacement returns


@contextlib.contextmanager
def skipping_blocks(model, indices: list[int]):
    """The model with the given blocks' computation left out for one call. The block modules stay in place, so
    the hooks on them (the sequence split before block 0) still run; every rank skips alike, so the collectives
    of the skipped blocks are skipped everywhere. An index past the last block skips nothing, as natively."""
    indices = [index for index in indices if 0 <= index < len(model.blocks)]
    # a step cache may have wrapped a block's forward (step_cache.py): it comes back after the call
    kept = {index: model.blocks[index].__dict__.get("forward") for index in indices}
    try:
        for index in indices:
            model.blocks[index].forward = _skipped_block_forward
        yield model
    finally:
        for index in indices:
            model.blocks[index].__dict__.pop("forward", None)
            if kept[index] is not None:
                model.blocks[index].forward = kept[index]
