"""Spatially tiled Wan VAE decode and encode, on one device or spread over ranks by the patch executor.

Decode cuts the raw latent ``[B, z, T, h, w]`` (z: 16 for the Wan 2.1 VAE, 48 for the Wan 2.2 VAE) into overlapping
spatial tiles; each tile is decoded over all frames by diffusers' ``AutoencoderKLWan`` (its causal temporal cache
included) and the pixel tiles are blended where they overlap. Tiles are decoded and blended raw; nothing is clamped here, so the output can leave -1..1 a little where
the decoder overshoots, as a whole-frame decode does, and is clamped once when it becomes frames. Encode does the same from pixels ``[B, 3, F, H, W]`` (the VAE chunks frames as 1 + 4n) and blends in latent
space. The split and merge are ours (rather than diffusers' ``enable_tiling``) so that tiles can run on different
ranks; the result does not depend on how many ranks run them. Sizes follow the loaded VAE's spatial factor (8 for
Wan 2.1, 16 for Wan 2.2, whose pixels enter and leave as 2x2 patches): tiles and overlaps are multiples of it.

Tiles start every ``tile - overlap`` along each axis; the last tile is cut at the border, and the grid is chosen so
it always extends past the previous tile's overlap. Blending uses linear ramps across each overlap whose weights sum to
one, so every output element is a convex combination of the tiles covering it.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from ..config import check_encode_frames, check_frame_size, resolve_tile_options
from ..distributed.patch_parallel import Coord, TileTask, run_patch_parallel
from .vae_stream import StreamingVaeDecoder

if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan

Span = tuple[int, int]
PIXEL_CHANNELS = 3  # RGB; the Wan 2.2 VAE's 12 input channels are these in 2x2 patches, made inside diffusers' encode


@dataclass(frozen=True)
class TileGrid:
    """Where each tile lands in the output: per-axis spans in output units, and the output's spatial size."""

    rows: tuple[Span, ...]
    cols: tuple[Span, ...]
    out_height: int
    out_width: int


def tile_spans(size: int, tile: int, overlap: int) -> list[Span]:
    """Overlapping ``[start, end)`` spans covering ``size``: stride ``tile - overlap``, the last one cut at the border.

    The tile count is the smallest that leaves the last tile longer than ``overlap``, so no tile lies wholly inside its
    neighbour and consecutive tiles always share exactly ``overlap`` elements.
    """
    if size <= tile:
        return [(0, size)]
    stride = tile - overlap
    count = math.ceil((size - overlap) / stride)
    return [(i * stride, min(i * stride + tile, size)) for i in range(count)]


def blend_ramp(spans: tuple[Span, ...], index: int, *, dtype: torch.dtype, device: torch.device) -> Tensor:
    """1-D blending weights of tile ``index`` along one axis: linear ramps over the overlaps with its neighbours.

    Within an overlap of width ``o`` the incoming tile weighs ``(k + 1) / (o + 1)`` and the outgoing one the rest, so
    the weights of the two tiles sum to one and neither is ever zero.
    """
    start, end = spans[index]
    weights = torch.ones(end - start, dtype=dtype, device=device)
    if index > 0:
        ramp_in = spans[index - 1][1] - start
        weights[:ramp_in] *= torch.arange(1, ramp_in + 1, dtype=dtype, device=device) / (ramp_in + 1)
    if index + 1 < len(spans):
        ramp_out = end - spans[index + 1][0]
        weights[end - start - ramp_out :] *= torch.arange(ramp_out, 0, -1, dtype=dtype, device=device) / (ramp_out + 1)
    return weights


def split_spatial(x: Tensor, tile: int, overlap: int, out_scale: float) -> tuple[list[TileTask], TileGrid]:
    """Cut ``x[..., H, W]`` into overlapping tile tasks; ``out_scale`` maps input extents to output extents."""
    height, width = x.shape[-2:]
    rows, cols = tile_spans(height, tile, overlap), tile_spans(width, tile, overlap)
    tasks = [
        TileTask(
            id=i * len(cols) + j,
            coord=(i, j),
            inputs=(x[..., r0:r1, c0:c1],),
            workload=float((r1 - r0) * (c1 - c0)),
        )
        for i, (r0, r1) in enumerate(rows)
        for j, (c0, c1) in enumerate(cols)
    ]
    grid = TileGrid(
        rows=tuple(_scale_span(s, out_scale) for s in rows),
        cols=tuple(_scale_span(s, out_scale) for s in cols),
        out_height=_scale(height, out_scale),
        out_width=_scale(width, out_scale),
    )
    return tasks, grid


def merge_blended(results: dict[Coord, Tensor], grid: TileGrid) -> Tensor:
    """Blend tile results ``[..., h, w]`` into one tensor by the ramps of :func:`blend_ramp`."""
    first = next(iter(results.values()))
    acc_dtype = torch.promote_types(first.dtype, torch.float32)
    out = torch.zeros(*first.shape[:-2], grid.out_height, grid.out_width, dtype=acc_dtype, device=first.device)
    weight_sum = torch.zeros(grid.out_height, grid.out_width, dtype=acc_dtype, device=first.device)
    for (i, j), tile in sorted(results.items()):
        (r0, r1), (c0, c1) = grid.rows[i], grid.cols[j]
        if tuple(tile.shape[-2:]) != (r1 - r0, c1 - c0):
            raise RuntimeError(
                f"tile {(i, j)} has spatial shape {tuple(tile.shape[-2:])}, expected {(r1 - r0, c1 - c0)}"
            )
        weight = torch.outer(
            blend_ramp(grid.rows, i, dtype=acc_dtype, device=out.device),
            blend_ramp(grid.cols, j, dtype=acc_dtype, device=out.device),
        )
        out[..., r0:r1, c0:c1] += tile.to(acc_dtype) * weight
        weight_sum[r0:r1, c0:c1] += weight
    # The ramps already sum to one; dividing removes rounding drift and guards against gaps in coverage.
    return (out / weight_sum).to(first.dtype)


def decode_raw(vae: AutoencoderKLWan, latents: Tensor) -> Tensor:
    """Decode raw latents ``[B, z, T, h, w]`` over whole frames without the clamp diffusers' ``decode`` applies.

    The same per-frame causal loop as diffusers' decode (``StreamingVaeDecoder`` on one chunk), so the pixels equal
    diffusers' before its clamp; tiles blended from these values match native tiled decoding, which clamps only after
    blending.
    """
    return StreamingVaeDecoder(vae).decode_pixels(latents)


def tiled_decode(
    vae: AutoencoderKLWan,
    latents: Tensor,
    *,
    tile_px: int = 256,
    overlap_px: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> Tensor | None:
    """Decode raw Wan latents ``[B, z, T, h, w]`` to raw pixels ``[B, 3, 1 + 4(T - 1), s*h, s*w]`` (s: the VAE's
    spatial factor; about -1..1, not clamped), tile by tile.

    ``tile_px`` / ``overlap_px`` are the tile edge and overlap in pixels. With a process group the tiles run on all its
    ranks and the pixels are returned on group rank 0; the other ranks get ``None``.
    """
    ratio = spatial_factor(vae)
    tile_px, overlap_px = resolve_tile_options(tile_px, overlap_px, ratio, decode=True)
    _check_latents(vae, latents)
    latents = latents.to(device=_device(vae), dtype=_dtype(vae))

    def decode_tile(task: TileTask) -> Tensor:
        return decode_raw(vae, task.inputs[0].contiguous())

    with torch.no_grad(), _without_builtin_tiling(vae):
        return run_patch_parallel(
            latents,
            lambda z: split_spatial(z, tile_px // ratio, overlap_px // ratio, out_scale=ratio),
            decode_tile,
            merge_blended,
            group=group,
            broadcast=False,
        )


def tiled_encode(
    vae: AutoencoderKLWan,
    pixels: Tensor,
    *,
    tile_px: int = 256,
    overlap_px: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Encode pixels ``[B, 3, F, H, W]`` in -1..1 (sizes multiples of the VAE's spatial factor; any F, encoded as
    1 + (F - 1) // 4 latent frames as the causal encoder does) to raw latents (the posterior mode), tile by tile.

    The tiles overlap by ``overlap_px`` pixels and are blended in latent space. With a process group the tiles run on
    all its ranks and the latents are broadcast so every rank returns them.
    """
    ratio = spatial_factor(vae)
    tile_px, overlap_px = resolve_tile_options(tile_px, overlap_px, ratio)
    _check_pixels(pixels, ratio)
    pixels = pixels.to(device=_device(vae), dtype=_dtype(vae))

    def encode_tile(task: TileTask) -> Tensor:
        return vae.encode(task.inputs[0].contiguous()).latent_dist.mode()

    with torch.no_grad(), _without_builtin_tiling(vae):
        return run_patch_parallel(
            pixels,
            lambda x: split_spatial(x, tile_px, overlap_px, out_scale=1 / ratio),
            encode_tile,
            merge_blended,
            group=group,
            broadcast=True,
        )


def _check_latents(vae: AutoencoderKLWan, latents: Tensor) -> None:
    z_dim = vae.config.z_dim
    if latents.ndim != 5 or latents.shape[1] != z_dim:
        raise ValueError(f"latents must be [B, {z_dim}, T, h, w] raw Wan latents, got shape {tuple(latents.shape)}")
    if min(latents.shape) < 1:
        raise ValueError(f"latents must not be empty, got shape {tuple(latents.shape)}")


def _check_pixels(pixels: Tensor, ratio: int) -> None:
    if pixels.ndim != 5 or pixels.shape[1] != PIXEL_CHANNELS:
        raise ValueError(f"pixels must be [B, {PIXEL_CHANNELS}, F, H, W] in -1..1, got shape {tuple(pixels.shape)}")
    frames, height, width = pixels.shape[2:]
    check_encode_frames(width, height, frames)
    check_frame_size(width, height, multiple=ratio)


def spatial_factor(vae: AutoencoderKLWan) -> int:
    """Pixels per latent along each spatial axis: 8 for the Wan 2.1 VAE, 16 for the Wan 2.2 VAE (from its config,
    which the loader checks against the structure)."""
    return int(vae.config.scale_factor_spatial)


def _device(vae: AutoencoderKLWan) -> torch.device:
    return next(vae.parameters()).device


def _dtype(vae: AutoencoderKLWan) -> torch.dtype:
    return next(vae.parameters()).dtype


def _scale(value: int, scale: float) -> int:
    return round(value * scale)


def _scale_span(span: Span, scale: float) -> Span:
    return _scale(span[0], scale), _scale(span[1], scale)


@contextmanager
def _without_builtin_tiling(vae: AutoencoderKLWan) -> Iterator[None]:
    """Each tile must go through the VAE whole; diffusers' own tiling, if switched on, would tile it again."""
    saved = getattr(vae, "use_tiling", False)
    vae.use_tiling = False
    try:
        yield
    finally:
        vae.use_tiling = saved
