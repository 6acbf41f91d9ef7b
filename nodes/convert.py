"""The one place that knows ComfyUI's IMAGE, LATENT and CONDITIONING types (DESIGN §2)."""

from __future__ import annotations

import torch


def conditioning_to_embeddings(conditioning) -> list[torch.Tensor]:
    """ComfyUI CONDITIONING ([[tensor[1, L, D], dict], ...]) -> prompt embeddings [L, D], one per batch row."""
    if not isinstance(conditioning, (list, tuple)) or not conditioning:
        raise ValueError("CONDITIONING is empty; connect a text encode node")
    tensor = conditioning[0][0]
    if not isinstance(tensor, torch.Tensor) or tensor.ndim != 3:
        raise ValueError(f"CONDITIONING tensor must be [batch, tokens, width], got {getattr(tensor, 'shape', tensor)}")
    return [row.float().cpu() for row in tensor]


def embeddings_to_conditioning(embeddings: list[torch.Tensor]) -> list:
    """Prompt embeddings (one prompt) -> ComfyUI CONDITIONING, as ComfyUI's own text encoders produce it."""
    (embedding,) = embeddings
    return [[embedding.unsqueeze(0), {}]]


def latent_to_tensor(latent: dict) -> torch.Tensor:
    """LATENT -> raw Wan latents [B, 16, T, h, w]."""
    samples = latent["samples"]
    if samples.ndim != 5:
        raise ValueError(f"this LATENT is {list(samples.shape)}, not a Wan video latent [B, 16, T, H/8, W/8]")
    return samples.float().cpu()


def tensor_to_latent(samples: torch.Tensor) -> dict:
    return {"samples": samples}


def image_to_frames(image: torch.Tensor) -> torch.Tensor:
    """IMAGE [F, H, W, C] 0..1 -> frames [F, H, W, 3]."""
    if image.ndim != 4:
        raise ValueError(f"IMAGE must be [frames, height, width, channels], got {list(image.shape)}")
    return image[..., :3].float().cpu()


def frames_to_image(frames: torch.Tensor) -> torch.Tensor:
    return frames.float().cpu()
