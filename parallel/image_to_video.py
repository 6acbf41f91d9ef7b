"""Image-to-video conditioning as native ComfyUI builds it; light (torch only), used by the driver and the workers.

The driver side (the WanMesh Image To Video node, ``wanmesh generate --image``) builds what native
``WanImageToVideo`` and ``WanFirstLastFrameToVideo`` build: the video the VAE encodes (the given frames resized and
center-cropped, grey elsewhere) and the mask of the given frames. The worker side turns the encoded image latents
and that mask into the 20 channels concatenated to an image-to-video model's input, as ComfyUI's Wan model does
(``image_concat``). The resizing helpers mirror ComfyUI's ``common_upscale`` (bilinear, center crop) and
``resize_to_batch_size`` because WanMesh must give the same numbers as the native nodes and nothing in
``parallel/`` imports ComfyUI.

Wan 2.2 TI2V 5B takes no concatenated channels: its image-to-video is the LATENT itself (native
``Wan22ImageToVideoLatent``: the start image's latents in the first latent frames, a ``noise_mask`` of 0 there). The
driver builds that LATENT (``wan22_start_frames``, ``wan22_image_latent``); the workers resize the mask to the latent
(``latent_noise_mask``, ComfyUI's ``reshape_mask``) and give each latent frame its timestep (``frame_timesteps``,
ComfyUI's WAN22 ``process_timestep``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .config import (IMAGE_CONCAT_CHANNELS, LATENT_CHANNELS, TEMPORAL_STRIDE, VAE_SPATIAL_FACTOR, WAN22_LATENT_CHANNELS,
                     WAN22_LATENTS_MEAN, WAN22_LATENTS_STD, WAN22_VAE_SPATIAL_FACTOR, check_frame_size)

MASK_CHANNELS = IMAGE_CONCAT_CHANNELS - LATENT_CHANNELS  # 4: one per frame a latent frame covers
GREY = 0.5  # the value of the frames no image is given for


def upscale_center(samples: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """``samples`` [..., C, H, W] (4-D images or 5-D [B, C, T, H, W]) center-cropped to the aspect of
    ``width`` x ``height`` and resized bilinearly to it (ComfyUI's ``common_upscale(..., "bilinear", "center")``)."""
    shape = tuple(samples.shape)
    if len(shape) > 4:
        samples = samples.reshape(shape[0], shape[1], -1, shape[-2], shape[-1]).movedim(2, 1)
        samples = samples.reshape(-1, shape[1], shape[-2], shape[-1])
    old_height, old_width = samples.shape[-2:]
    old_aspect, new_aspect = old_width / old_height, width / height
    x = round((old_width - old_width * (new_aspect / old_aspect)) / 2) if old_aspect > new_aspect else 0
    y = round((old_height - old_height * (old_aspect / new_aspect)) / 2) if old_aspect < new_aspect else 0
    cropped = samples.narrow(-2, y, old_height - 2 * y).narrow(-1, x, old_width - 2 * x)
    out = F.interpolate(cropped, size=(height, width), mode="bilinear")
    if len(shape) == 4:
        return out
    return out.reshape(shape[0], -1, shape[1], height, width).movedim(2, 1).reshape(*shape[:-2], height, width)


def resize_to_batch(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """``tensor`` with ``batch`` rows, picking rows evenly (ComfyUI's ``resize_to_batch_size``)."""
    given = tensor.shape[0]
    if given == batch:
        return tensor
    if batch <= 1:
        return tensor[:batch]
    if batch < given:
        scale = (given - 1) / (batch - 1)
        picks = [min(round(i * scale), given - 1) for i in range(batch)]
    else:
        scale = given / batch
        picks = [min(math.floor((i + 0.5) * scale), given - 1) for i in range(batch)]
    return tensor[picks]


def latent_frame_count(length: int) -> int:
    return (length - 1) // TEMPORAL_STRIDE + 1


def _fitted(images: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """IMAGE [F, H, W, C] resized and center-cropped to width x height."""
    return upscale_center(images.movedim(-1, 1), width, height).movedim(1, -1)


def start_image_video(start: torch.Tensor | None, width: int, height: int, length: int):
    """(video [length, height, width, 3], mask [1, 1, latent frames, h, w]) as ``WanImageToVideo`` builds them:
    the start frames (at most ``length``) then grey; the mask 0 on the latent frames the start frames cover.
    None for both without a start image (the node then adds no image conditioning)."""
    if start is None:
        return None, None
    start = _fitted(start[:length].float(), width, height)
    video = torch.full((length, height, width, start.shape[-1]), GREY)
    video[: start.shape[0]] = start
    latent_frames = latent_frame_count(length)
    mask = torch.ones(1, 1, latent_frames, height // VAE_SPATIAL_FACTOR, width // VAE_SPATIAL_FACTOR)
    mask[:, :, : latent_frame_count(start.shape[0])] = 0.0
    return video[..., :3], mask


def stream_start_frame(start: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """The frame ``ARVideoI2V`` encodes to start a causal stream: the first image only, resized and center-cropped
    to ``width`` x ``height``, RGB [1, height, width, 3] (one latent frame once encoded)."""
    return _fitted(start[:1].float(), width, height)[..., :3]


def first_last_video(start: torch.Tensor | None, end: torch.Tensor | None, width: int, height: int, length: int):
    """(video [length, height, width, 3], mask [1, 4, latent frames, h, w]) as ``WanFirstLastFrameToVideo`` builds
    them: start frames first, end frames last, grey between; the mask 0 on the frames given (a start frame also
    covers the three frames after it, as the VAE's first latent frame is one frame)."""
    latent_frames = latent_frame_count(length)
    video = torch.full((length, height, width, 3), GREY)
    mask = torch.ones(1, 1, latent_frames * TEMPORAL_STRIDE, height // VAE_SPATIAL_FACTOR, width // VAE_SPATIAL_FACTOR)
    if start is not None:
        start = _fitted(start[:length].float(), width, height)
        video[: start.shape[0]] = start[..., :3]
        mask[:, :, : start.shape[0] + 3] = 0.0
    if end is not None:
        end = _fitted(end[-length:].float(), width, height)
        video[-end.shape[0]:] = end[..., :3]
        mask[:, :, -end.shape[0]:] = 0.0
    mask = mask.view(1, latent_frames, TEMPORAL_STRIDE, *mask.shape[-2:]).transpose(1, 2)
    return video, mask


def image_concat(image_latents: torch.Tensor, mask: torch.Tensor | None, latent_shape: tuple,
                 mean: torch.Tensor, std: torch.Tensor, extra_channels: int = IMAGE_CONCAT_CHANNELS,
                 image_to_video: bool = True, mask_index: int = 0) -> torch.Tensor:
    """The ``extra_channels`` [B, extra, T, h, w] concatenated to a conditioned model's input, as ComfyUI's Wan
    ``concat_cond`` builds them: the image latents (each 16 channels normalised with the Wan latent ``mean``/``std``)
    resized to the latent's size and batch (``mean``/``std`` of the model's latent: 16 or 48 channels); given as they are when they fill the extra channels (Wan 2.1 Fun
    Control: the control video's and the start image's latents), else after the mask of the given frames,
    inverted (1 where a frame is given) with one channel per frame of a latent frame (zeros without a mask), at
    channel ``mask_index`` (image-to-video: 4 mask and 16 image channels)."""
    batch, _, frames, h, w = latent_shape
    image = upscale_center(image_latents.float(), w, h)
    chunks = [(image[:, i: i + mean.numel()] - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)
              for i in range(0, image.shape[1], mean.numel())]
    image = resize_to_batch(torch.cat(chunks, dim=1), batch)
    if extra_channels != image.shape[1] + MASK_CHANNELS and (not image_to_video or extra_channels == image.shape[1]):
        return image
    image = image[:, : extra_channels - MASK_CHANNELS]
    if mask is None:
        mask = torch.zeros(batch, MASK_CHANNELS, *image.shape[2:])
    else:
        mask = mask.float()
        if mask.shape[1] != MASK_CHANNELS:
            mask = mask.mean(dim=1, keepdim=True)
        mask = upscale_center(1.0 - mask, w, h)
        if mask.shape[2] < frames:
            mask = F.pad(mask, (0, 0, 0, 0, 0, frames - mask.shape[2]))
        if mask.shape[1] == 1:
            mask = mask.repeat(1, MASK_CHANNELS, 1, 1, 1)
        mask = resize_to_batch(mask, batch)
    return torch.cat([image[:, :mask_index], mask, image[:, mask_index:]], dim=1)


# -- Fun Control: a control video, a start image (Wan 2.1) or a reference image (Wan 2.2) -----------------------------


def fun_control_frames(images: torch.Tensor | None, width: int, height: int, length: int) -> torch.Tensor | None:
    """The frames native WanFunControlToVideo / Wan22FunControlToVideo encode of a control video or start image:
    at most ``length``, resized and center-cropped, RGB; None for none."""
    return None if images is None else _fitted(images[:length].float(), width, height)[..., :3]


def fun_control_latents(control: torch.Tensor | None, start: torch.Tensor | None, latent_shape: tuple,
                        mean: torch.Tensor) -> torch.Tensor:
    """The raw ``concat_latent_image`` [1, 2C, T, h, w] of the Fun Control nodes: the control video's latents in
    the first C channels, the start image's in the last C, each over the frames it covers; the rest the latent
    space's zero (its ``mean`` as raw latents)."""
    channels, frames = mean.numel(), latent_shape[2]
    concat = mean.view(1, -1, 1, 1, 1).expand(1, channels, *latent_shape[2:]).repeat(1, 2, 1, 1, 1)
    for offset, encoded in ((0, control), (channels, start)):
        if encoded is not None:
            given = encoded[:, :, :frames]
            concat[:, offset: offset + channels, : given.shape[2]] = given
    return concat


def fun22_control_mask(latent_shape: tuple) -> torch.Tensor:
    """Wan22FunControlToVideo's ``concat_mask`` [1, 4, T, h, w]: ones (it takes no start image)."""
    return torch.ones(1, MASK_CHANNELS, *latent_shape[2:])


# -- Wan 2.2 TI2V 5B: the start image in the latent, a noise mask ------------------------------------------------------


def wan22_start_frames(start: torch.Tensor | None, width: int, height: int, length: int) -> torch.Tensor | None:
    """The frames ``Wan22ImageToVideoLatent`` VAE-encodes: the first ``length`` start images IMAGE [F, H, W, C]
    resized and center-cropped to width x height, RGB; None without a start image."""
    check_frame_size(width, height, WAN22_VAE_SPATIAL_FACTOR)
    if start is None:
        return None
    return _fitted(start[:length].float(), width, height)[..., :3]


def wan22_image_latent(encoded: torch.Tensor | None, width: int, height: int, length: int,
                       batch_size: int) -> dict[str, torch.Tensor]:
    """The LATENT of ``Wan22ImageToVideoLatent`` (``samples``, and ``noise_mask`` with a start image) from the raw
    latents of the encoded start frames [1, 48, t, h, w]: those latents in the first ``t`` latent frames (raw), the
    empty latent elsewhere (the latent mean: zero once normalised), the mask 0 on the encoded frames. Without a
    start image, one empty latent row and no mask (as native, which then ignores ``batch_size``)."""
    check_frame_size(width, height, WAN22_VAE_SPATIAL_FACTOR)
    shape = (1, WAN22_LATENT_CHANNELS, latent_frame_count(length), height // WAN22_VAE_SPATIAL_FACTOR,
             width // WAN22_VAE_SPATIAL_FACTOR)
    latent = torch.zeros(shape)
    if encoded is None:
        return {"samples": latent}
    if tuple(encoded.shape[:2]) != shape[:2] or tuple(encoded.shape[3:]) != shape[3:] or encoded.shape[2] > shape[2]:
        raise ValueError(f"the encoded start image has shape {list(encoded.shape)}; expected [1, "
                         f"{WAN22_LATENT_CHANNELS}, at most {shape[2]}, {shape[3]}, {shape[4]}] (the Wan 2.2 VAE's "
                         "latents of width x height frames)")
    mask = torch.ones(1, 1, *shape[2:])
    latent[:, :, : encoded.shape[2]] = encoded.float()
    mask[:, :, : encoded.shape[2]] *= 0.0
    mean = torch.tensor(WAN22_LATENTS_MEAN).view(1, -1, 1, 1, 1)
    std = torch.tensor(WAN22_LATENTS_STD).view(1, -1, 1, 1, 1)
    latent = (latent * std / 1.0 + mean) * mask + latent * (1.0 - mask)  # native: Wan22 process_out, scale 1
    repeat = (batch_size, 1, 1, 1, 1)
    return {"samples": latent.repeat(repeat), "noise_mask": mask.repeat(repeat)}


def latent_noise_mask(noise_mask: torch.Tensor, latent_shape: tuple) -> torch.Tensor:
    """A LATENT's ``noise_mask`` resized to the latent [B, C, T, h, w] as ComfyUI's sampler prepares it
    (``reshape_mask``): a mask without its 5 dimensions taken as frames [1, 1, F, H, W], trilinear to the latent's
    frames and size, repeated over the channels and to the batch."""
    mask = noise_mask.float()
    if mask.ndim < 5:
        mask = mask.reshape(1, 1, -1, mask.shape[-2], mask.shape[-1])
    mask = F.interpolate(mask, size=tuple(latent_shape[2:]), mode="trilinear")
    channels, batch = latent_shape[1], latent_shape[0]
    if mask.shape[1] < channels:
        mask = mask.repeat(1, channels, 1, 1, 1)[:, :channels]
    if mask.shape[0] > batch:
        return mask[:batch]
    if mask.shape[0] < batch:
        return mask.repeat(math.ceil(batch / mask.shape[0]), 1, 1, 1, 1)[:batch]
    return mask


def frame_timesteps(mask: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
    """Per-frame timesteps [B, T] of a model call on a masked latent (ComfyUI's WAN22 ``process_timestep``): each
    latent frame's share of sampled positions (the mask's mean over channels, height and width) times the
    timestep (one value, or one per row)."""
    rows = mask.shape[0]
    shares = torch.mean(mask, dim=(1, 3, 4), keepdim=True)
    return (shares * timestep.expand(rows).view(rows, 1, 1, 1, 1)).reshape(rows, -1)
