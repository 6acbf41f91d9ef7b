"""The CLIP vision image encoder that Wan 2.1 image-to-video conditions on: encoding ComfyUI IMAGE tensors as native
CLIPVisionEncode does; runs in the ComfyUI process (the CLIP vision nodes: one small model, one image at a time) or
the CLI. Reading ``clip_vision_h.safetensors`` into transformers' ``CLIPVisionModelWithProjection`` is
``weights/clip_vision_files.py``. The outputs are ComfyUI's CLIP_VISION_OUTPUT fields (``ClipVisionOutput``); Wan
reads ``penultimate_hidden_states``, [N, 257, 1280] for ViT-H at 224 px.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch
from transformers import CLIPVisionModelWithProjection

__all__ = ["CLIP_MEAN", "CLIP_STD", "ClipVisionOutput", "clip_preprocess", "encode_images"]

# OpenAI CLIP's normalisation, which ComfyUI's clip_preprocess defaults to (every CLIP, ViT-H included).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)


CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class ClipVisionOutput:
    """ComfyUI's CLIP_VISION_OUTPUT (``comfy.clip_vision.Output``) fields, read as attributes or items:
    ``last_hidden_state`` (the last layer's tokens, before the post-LayerNorm), ``image_embeds`` (the projected,
    post-LayerNormed class token), ``penultimate_hidden_states`` (the tokens after the next-to-last layer: what Wan
    takes) and ``mm_projected`` (None: a LLaVA projector's output, which CLIP vision files do not have)."""

    last_hidden_state: torch.Tensor
    image_embeds: torch.Tensor
    penultimate_hidden_states: torch.Tensor
    mm_projected: torch.Tensor | None = None

    def __getitem__(self, key: str):
        return getattr(self, key)

    def __setitem__(self, key: str, value) -> None:
        setattr(self, key, value)

    def items(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        return ((field.name, getattr(self, field.name)) for field in fields(self))


def _check_images(images: torch.Tensor) -> None:
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[-1] < 3 or 0 in images.shape:
        raise ValueError(f"CLIP vision images must be a ComfyUI IMAGE [count, height, width, 3 (or 4)] in 0..1, got "
                         f"{tuple(getattr(images, 'shape', ())) or type(images).__name__}.")


def clip_preprocess(images: torch.Tensor, size: int = 224, *, crop: bool = True, mean=CLIP_MEAN,
                    std=CLIP_STD) -> torch.Tensor:
    """ComfyUI IMAGE [N, H, W, C] in 0..1 -> normalised pixels [N, 3, size, size].

    Mirrors ComfyUI's ``comfy.clip_vision.clip_preprocess`` step for step, so the tokens match native
    CLIPVisionEncode's: an alpha channel is dropped; an image not already size x size is resized bicubic with
    antialiasing, its short side to ``size`` then a centre crop (``crop``) or both sides to ``size`` (no crop); the
    pixels are rounded to 8-bit levels and normalised with the CLIP mean and std.
    """
    _check_images(images)
    images = images[..., :3].movedim(-1, 1)
    if images.shape[2:] != (size, size):
        if crop:
            scale = size / min(images.shape[2], images.shape[3])
            scaled = (round(scale * images.shape[2]), round(scale * images.shape[3]))
        else:
            scaled = (size, size)
        images = torch.nn.functional.interpolate(images, size=scaled, mode="bicubic", antialias=True)
        top, left = (images.shape[2] - size) // 2, (images.shape[3] - size) // 2
        images = images[:, :, top:top + size, left:left + size]
    images = torch.clip(255.0 * images, 0, 255).round() / 255.0
    mean = torch.tensor(mean, device=images.device, dtype=images.dtype).view(3, 1, 1)
    std = torch.tensor(std, device=images.device, dtype=images.dtype).view(3, 1, 1)
    return (images - mean) / std


@contextlib.contextmanager
def _penultimate_tokens(model: CLIPVisionModelWithProjection) -> Iterator[list[torch.Tensor]]:
    """Captures the output of the next-to-last encoder layer (ComfyUI's ``intermediate_output=-2``)."""
    captured: list[torch.Tensor] = []

    def keep(module, args, output):
        captured.append(output[0] if isinstance(output, tuple) else output)  # a tuple in transformers 4.x

    handle = model.vision_model.encoder.layers[-2].register_forward_hook(keep)
    try:
        yield captured
    finally:
        handle.remove()


def encode_images(model: CLIPVisionModelWithProjection, images: torch.Tensor, *, crop: bool = True) -> ClipVisionOutput:
    """Encode ComfyUI IMAGE ``images`` [N, H, W, 3] in 0..1 as native CLIPVisionEncode does (``clip_preprocess``,
    then the model on the model's device and dtype); the outputs are float32 on the CPU (ComfyUI's intermediate
    device)."""
    parameter = next(model.parameters())
    pixels = clip_preprocess(images.to(parameter.device, torch.float32), model.config.image_size, crop=crop)
    with torch.inference_mode(), _penultimate_tokens(model) as penultimate:
        out = model(pixel_values=pixels.to(parameter.dtype))
    return ClipVisionOutput(last_hidden_state=out.last_hidden_state.float().cpu(),
                            image_embeds=out.image_embeds.float().cpu(),
                            penultimate_hidden_states=penultimate[-1].float().cpu())

