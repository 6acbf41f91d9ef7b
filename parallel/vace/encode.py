"""The native VACE conditioning format (ComfyUI's `WanVaceToVideo`) as pure tensor functions; runs in the worker processes.

Inputs follow ComfyUI: IMAGE `[F, H, W, C]` and MASK `[F, H, W]` in 0..1 (mask 1 = generate, 0 = keep).
Outputs are in the **raw** Wan VAE latent space: `frames [1, 32, R+T, h, w]` (inactive | reactive latents,
references prepended in time), `mask [1, 64, R+T, h, w]` (each 8x8 pixel block folded onto channels) and
`trim_latent = R`. A control video or masks of another frame count than the length are cut or padded (grey frames,
ones) as native does. With at most one reference the result equals the native node's (the nodes pass only the
first reference unless asked for all); several references each become their own latent frame, prepended in
order (as the official VACE does): an extension beyond native.
The VAE encode is supplied by the caller (`encode_frames`), so a tiled or patch-parallel encode fits unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..config import (
    LATENT_CHANNELS,
    SPATIAL_STRIDE,
    TEMPORAL_STRIDE,
    VAE_SPATIAL_FACTOR,
    check_frame_count,
    check_frame_size,
)

GREY = 0.5

EncodeFrames = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class VaceEncoding:
    """One VACE context in raw VAE latent space: `frames [1,32,R+T,h,w]`, `mask [1,64,R+T,h,w]`, `trim_latent = R`."""

    frames: torch.Tensor
    mask: torch.Tensor
    trim_latent: int


def latent_frame_count(length: int) -> int:
    """Latent frames T of a `length = 4k+1` frame video."""
    return (length - 1) // TEMPORAL_STRIDE + 1


# --- canvas fitting -------------------------------------------------------------------------------

def _centre_crop_offsets(source_width: int, source_height: int, width: int, height: int) -> tuple[int, int]:
    """Pixels (x, y) cut from each side so the source takes the target aspect; ComfyUI's float arithmetic and
    Python's round (half to even) so crops match `common_upscale(..., "center")` exactly."""
    source_aspect = source_width / source_height
    target_aspect = width / height
    if source_aspect > target_aspect:
        return round((source_width - source_width * (target_aspect / source_aspect)) / 2), 0
    if source_aspect < target_aspect:
        return 0, round((source_height - source_height * (source_aspect / target_aspect)) / 2)
    return 0, 0


def _fit_channels_first(samples: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Centre-crop `[N, C, H, W]` to the target aspect, then bilinear resize (align_corners off, no antialias)."""
    source_height, source_width = samples.shape[-2:]
    x, y = _centre_crop_offsets(source_width, source_height, width, height)
    cropped = samples[..., y:source_height - y, x:source_width - x]
    return torch.nn.functional.interpolate(cropped, size=(height, width), mode="bilinear")


def fit_to_canvas(frames: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """`[F, H, W, C]` -> `[F, height, width, C]`: centre crop to the canvas aspect, then bilinear resize.

    Same crop arithmetic and the same `interpolate` call on the same strided `movedim` view as ComfyUI, so the
    result matches ComfyUI's bit for bit.
    """
    return _fit_channels_first(frames.movedim(-1, 1), width, height).movedim(1, -1)


def _fit_masks(masks: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """`[F, H, W]` -> `[F, height, width]`, resized as one-channel images (ComfyUI unsqueezes a channel)."""
    return _fit_channels_first(masks.unsqueeze(1), width, height).squeeze(1)


def _pad_frames(frames: torch.Tensor, length: int, value: float) -> torch.Tensor:
    """Append frames filled with `value` up to `length` frames."""
    missing = length - frames.shape[0]
    if missing <= 0:
        return frames
    filler = frames.new_full((missing, *frames.shape[1:]), value)
    return torch.cat([frames, filler], dim=0)


def control_inputs(width: int, height: int, length: int, control_video: Optional[torch.Tensor] = None,
                   control_masks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The pixel-space control video `[length, H, W, 3]` (grey where absent) and mask `[length, H, W]` (ones where absent)."""
    given = control_video if control_video is not None else control_masks
    device = given.device if given is not None else None
    if control_video is None:
        video = torch.full((length, height, width, 3), GREY, device=device)
    else:
        video = _pad_frames(fit_to_canvas(control_video[:length], width, height)[..., :3], length, GREY)
    if control_masks is None:
        mask = torch.ones((length, height, width), device=device)
    else:
        mask = _pad_frames(_fit_masks(control_masks[:length], width, height), length, 1.0)
    return video, mask


def split_inactive_reactive(video: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Video `[F,H,W,3]` and mask `[F,H,W]` -> (inactive: the kept pixels, reactive: the pixels to regenerate), grey elsewhere."""
    centred = video - GREY
    channel_mask = mask.unsqueeze(-1)
    inactive = centred * (1 - channel_mask) + GREY
    reactive = centred * channel_mask + GREY
    return inactive, reactive


def fold_mask(mask: torch.Tensor, latent_frames: int) -> torch.Tensor:
    """Mask `[F, H, W]` -> `[64, T, H/8, W/8]`: each 8x8 pixel block onto channels (row offset major), then
    nearest-exact resampling of the frames to the `latent_frames` latent frames."""
    frames, height, width = mask.shape
    h, w = height // VAE_SPATIAL_FACTOR, width // VAE_SPATIAL_FACTOR
    blocks = mask.reshape(frames, h, VAE_SPATIAL_FACTOR, w, VAE_SPATIAL_FACTOR).permute(2, 4, 0, 1, 3)
    folded = blocks.reshape(VAE_SPATIAL_FACTOR * VAE_SPATIAL_FACTOR, frames, h, w)
    resampled = torch.nn.functional.interpolate(folded.unsqueeze(0), size=(latent_frames, h, w), mode="nearest-exact")
    return resampled.squeeze(0)


# --- encoding -------------------------------------------------------------------------------------

def _encode_references(encode_frames: EncodeFrames, reference_images: torch.Tensor, width: int, height: int,
                       latents_mean: torch.Tensor) -> torch.Tensor:
    """References `[N, H, W, C]` -> `[1, 32, N, h, w]`: each its own 1-frame video, paired with the raw value of a
    zero normalised latent (the latent mean), in the given order."""
    fitted = fit_to_canvas(reference_images, width, height)[..., :3]
    latents = []
    for index in range(fitted.shape[0]):
        latent = encode_frames(fitted[index:index + 1])
        mean = latents_mean.to(device=latent.device, dtype=latent.dtype).view(1, LATENT_CHANNELS, 1, 1, 1)
        latents.append(torch.cat([latent, mean.expand_as(latent)], dim=1))
    return torch.cat(latents, dim=2)


def encode_vace(encode_frames: EncodeFrames, width: int, height: int, length: int, latents_mean: torch.Tensor,
                control_video: Optional[torch.Tensor] = None, control_masks: Optional[torch.Tensor] = None,
                reference_images: Optional[torch.Tensor] = None) -> VaceEncoding:
    """One VACE context in the native format; `encode_frames([F,H,W,3] in 0..1)` returns raw latents `[1,16,T',h,w]`."""
    check_encode_inputs(width, height, length, control_video, control_masks, reference_images)
    video, mask = control_inputs(width, height, length, control_video, control_masks)
    inactive, reactive = split_inactive_reactive(video, mask)
    frames = torch.cat([encode_frames(inactive), encode_frames(reactive)], dim=1)
    folded = fold_mask(mask, latent_frame_count(length)).to(frames.device)
    if reference_images is None:
        return VaceEncoding(frames=frames, mask=folded.unsqueeze(0), trim_latent=0)
    references = _encode_references(encode_frames, reference_images, width, height, latents_mean)
    reference_count = references.shape[2]
    reference_mask = folded.new_zeros((folded.shape[0], reference_count, *folded.shape[2:]))
    return VaceEncoding(frames=torch.cat([references.to(frames.dtype), frames], dim=2),
                        mask=torch.cat([reference_mask, folded], dim=1).unsqueeze(0), trim_latent=reference_count)


# --- input checks ---------------------------------------------------------------------------------

def _check_canvas(width: int, height: int, length: int) -> None:
    check_frame_size(width, height, SPATIAL_STRIDE, where="VACE ")
    check_frame_count(length, "VACE length")


def _check_image(name: str, image: torch.Tensor) -> None:
    if image.ndim != 4 or image.shape[0] < 1 or image.shape[-1] not in (3, 4):
        raise ValueError(f"VACE {name} must be an IMAGE [frames, H, W, 3 or 4] with at least one frame, "
                         f"got shape {tuple(image.shape)}")


def _check_masks(control_masks: torch.Tensor) -> None:
    if control_masks.ndim != 3 or control_masks.shape[0] < 1:
        raise ValueError(f"VACE control_masks must be a MASK [frames, H, W] with at least one frame, "
                         f"got shape {tuple(control_masks.shape)}")
    low, high = control_masks.min().item(), control_masks.max().item()
    if low < 0 or high > 1:
        raise ValueError(f"VACE control_masks values must lie in 0..1, got min {low:g} and max {high:g}")


def frame_count_changes(length: int, control_video: Optional[torch.Tensor] = None,
                        control_masks: Optional[torch.Tensor] = None) -> list[str]:
    """What ``control_inputs`` does to inputs whose frame count is not ``length``, as native WanVaceToVideo does:
    longer ones are cut, shorter ones padded (the video with grey frames, the masks with ones: generate)."""
    changes = []
    for name, tensor, filler in (("control video has", control_video, "grey frames"),
                                 ("control masks have", control_masks, "ones (generate)")):
        if tensor is None or tensor.shape[0] == length:
            continue
        if tensor.shape[0] > length:
            changes.append(f"the {name} {tensor.shape[0]} frames: cut to the first {length}")
        else:
            changes.append(f"the {name} {tensor.shape[0]} frames: padded to {length} with {filler}")
    return changes


def check_encode_inputs(width: int, height: int, length: int, control_video: Optional[torch.Tensor] = None,
                        control_masks: Optional[torch.Tensor] = None,
                        reference_images: Optional[torch.Tensor] = None) -> None:
    """Raise a one-line ValueError for any input `encode_vace` cannot take, before any VAE work."""
    _check_canvas(width, height, length)
    if control_video is not None:
        _check_image("control_video", control_video)
    if control_masks is not None:
        _check_masks(control_masks)
    if reference_images is not None:
        _check_image("reference_images", reference_images)
