"""The single-device engine: owns the models loaded on one device and runs requests on them.

Every worker of the pool holds one Engine; parallel execution is applied to it from outside. Models stay
resident between requests, keyed by kind, file and options, until unloaded.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable

import torch
import torch.distributed as dist

from . import loaders
from .guidance import guidance_for
from .patch_executor import effective_patch_size
from .sampling import Cancelled, SampleRequest, sample
from .vae_tiling import tiled_decode, tiled_encode
from .video import check_latent, frames_to_pixels, pixels_to_frames

__all__ = ["Engine", "Cancelled", "SampleRequest", "resolve_dtype", "DTYPES"]

DEFAULT_PARALLEL_TILE_PX = 256  # tile edge when VAE work is spread over ranks and no tile size was given
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on accelerators and fp32 on the CPU (CPU half-precision kernels are slow and inexact)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is unknown; valid: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


class Engine:
    """Models on one device and the operations the nodes and the command line need."""

    def __init__(self, device: str | torch.device = "cpu", parallel=None):
        self.device = torch.device(device)
        self.parallel = parallel  # ParallelContext of this rank, or None for a plain single-device engine
        self._models: dict[str, object] = {}
        self._vae_groups: dict[int, object] = {}

    def _degree(self, dim: str) -> int:
        return self.parallel.size(dim) if self.parallel is not None and self.parallel.is_distributed else 1

    # -- loading ---------------------------------------------------------------------------------------

    def _load(self, key: str, make: Callable[[], object]) -> str:
        if key not in self._models:
            self._models[key] = make()
        return key

    def load_model(self, path: str, *, vace_module: str | None = None, dtype: str = "auto") -> str:
        torch_dtype = resolve_dtype(dtype, self.device)
        key = f"model|{path}|{vace_module or ''}|{torch_dtype}"
        return self._load(key, lambda: self._load_transformer(path, vace_module, torch_dtype))

    def _load_transformer(self, path: str, vace_module: str | None, torch_dtype: torch.dtype):
        """The transformer, tensor-parallel when tp > 1, then with its sequence split when ring x ulysses > 1."""
        if self._degree("tp") * self._degree("ulysses") > 1:  # heads split over these: check before reading weights
            self.parallel.config.check_heads(transformer_heads(path, vace_module))
        if self._degree("tp") == 1:
            model = loaders.load_transformer(path, vace_module=vace_module, dtype=torch_dtype, device=self.device)
        else:
            from .sharded_loading import load_transformer_tp

            model = load_transformer_tp(
                path, vace_module=vace_module, dtype=torch_dtype, device=self.device, tp_group=self.parallel.tp_group
            )
        if self._degree("ring") * self._degree("ulysses") > 1:
            from .context_parallel import apply_context_parallel

            apply_context_parallel(model, ring_group=self.parallel.ring_group, ulysses_group=self.parallel.ulysses_group)
        return model

    def load_vae(self, path: str, *, dtype: str = "auto") -> str:
        torch_dtype = resolve_dtype(dtype, self.device)
        return self._load(f"vae|{path}|{torch_dtype}", lambda: loaders.load_vae(path, dtype=torch_dtype, device=self.device))

    def load_text_encoder(self, path: str, *, dtype: str = "auto") -> str:
        """umT5, tensor-parallel over the tp group when tp > 1 (then every rank of the group encodes together)."""
        torch_dtype = resolve_dtype(dtype, self.device)
        return self._load(f"text|{path}|{torch_dtype}", lambda: self._load_umt5(path, torch_dtype))

    def _load_umt5(self, path: str, torch_dtype: torch.dtype):
        if self._degree("tp") == 1:
            return loaders.load_text_encoder(path, dtype=torch_dtype, device=self.device)
        from .text_encoder_tp import load_text_encoder_tp

        return load_text_encoder_tp(path, dtype=torch_dtype, device=self.device, tp_group=self.parallel.tp_group)

    def unload(self, handle: str | None = None) -> None:
        if handle is None:
            self._models.clear()
        else:
            self._models.pop(handle, None)

    def loaded(self) -> list[str]:
        return list(self._models)

    def _get(self, handle: str, kind: str):
        if handle not in self._models:
            raise KeyError(f"no {kind} is loaded under {handle!r}; load it first (loaded: {self.loaded() or 'nothing'})")
        if not handle.startswith(kind + "|"):
            raise TypeError(f"{handle!r} is not a {kind}")
        return self._models[handle]

    # -- work ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_text(self, handle: str, prompts: list[str]) -> list[torch.Tensor]:
        return self._get(handle, "text").encode(prompts)

    @torch.no_grad()
    def sample(self, handle: str, request: SampleRequest, progress=None, should_stop=None) -> torch.Tensor:
        model = self._get(handle, "model")
        check_conditioning(model, request)
        dtype = next(model.parameters()).dtype
        rows = self._batch_rows(request.latent.shape[0])
        latents = sample(
            model, request, device=self.device, dtype=dtype, progress=progress, should_stop=should_stop, rows=rows,
            guidance=self._guidance(),
        )
        return self._gather_batch(latents, request.latent.shape[0])

    def _guidance(self):
        """CFG parallel: this rank's half of the guidance passes (the plain two-pass guidance otherwise)."""
        cfg = self._degree("cfg")
        if cfg == 1:
            return None
        return guidance_for(self.parallel.cfg_group, cfg, self.parallel.coord("cfg"))

    def _batch_rows(self, batch: int) -> range:
        """The batch rows this data-parallel replica samples: contiguous, near-equal shares."""
        dp = self._degree("dp")
        if dp == 1:
            return range(batch)
        index = self.parallel.coord("dp")
        return range(index * batch // dp, (index + 1) * batch // dp)

    def _gather_batch(self, latents: torch.Tensor, batch: int) -> torch.Tensor:
        """Reassemble the whole batch from the data-parallel replicas (every replica gets it)."""
        dp = self._degree("dp")
        if dp == 1:
            return latents
        # all_gather needs equal shapes: pad every share to the largest, then cut by the known row ranges.
        largest = -(-batch // dp)
        padded = latents.new_zeros((largest, *latents.shape[1:]))
        padded[: latents.shape[0]] = latents
        pieces = [torch.empty_like(padded) for _ in range(dp)]
        dist.all_gather(pieces, padded.to(self.device).contiguous(), group=self.parallel.dp_group)
        shares = [(i * batch // dp, (i + 1) * batch // dp) for i in range(dp)]
        return torch.cat([piece[: stop - start].cpu() for piece, (start, stop) in zip(pieces, shares)])

    def _tiling(self, tile_px: int | None):
        """(tile group, tile edge, whether this rank decodes tiles). The tile group is the first vae_patch ranks;
        a tile edge of None means whole frames on this rank."""
        size = 1
        if self.parallel is not None and self.parallel.is_distributed:
            size = effective_patch_size(self.parallel.config.vae_patch, self.parallel.world)
        if size == 1:
            return None, tile_px, True
        if size not in self._vae_groups:  # every rank runs every request, so all ranks create it together
            self._vae_groups[size] = dist.new_group(ranks=list(range(size)))
        return self._vae_groups[size], tile_px or DEFAULT_PARALLEL_TILE_PX, self.parallel.rank < size

    @torch.no_grad()
    def decode(self, handle: str, latents: torch.Tensor, tile_px: int | None = None, overlap_px: int | None = None):
        """Raw latents [B, 16, T, h, w] -> frames [B*F, H, W, 3] in 0..1 on the first rank (None on the others).

        With a tile edge (or vae_patch > 1) the frames are cut into overlapping tiles spread over the tile ranks."""
        vae = self._get(handle, "vae")
        if latents.ndim != 5 or latents.shape[1] != vae.config.z_dim:
            raise ValueError(f"expected Wan latents [B, {vae.config.z_dim}, T, h, w], got shape {list(latents.shape)}")
        group, tile_px, takes_part = self._tiling(tile_px)
        if not takes_part:
            return None
        if tile_px is None:
            pixels = vae.decode(latents.to(self.device, vae.dtype), return_dict=False)[0]
        else:
            pixels = tiled_decode(vae, latents, tile_px=tile_px, overlap_px=overlap_px, group=group)
        return None if pixels is None else pixels_to_frames(pixels)

    @torch.no_grad()
    def encode(self, handle: str, frames: torch.Tensor, tile_px: int | None = None, overlap_px: int | None = None):
        """Frames [F, H, W, 3] in 0..1 -> raw latents [1, 16, T, h, w] (the posterior mode, as Wan uses).

        Tiling works as in `decode`; the merged latents reach every tile rank."""
        vae = self._get(handle, "vae")
        pixels = frames_to_pixels(frames)
        count, height, width = pixels.shape[2:]
        if (count - 1) % 4 or height % 8 or width % 8:
            raise ValueError(
                f"cannot encode {count} frames of {width}x{height}: the Wan VAE needs 4k+1 frames and sides that "
                "are multiples of 8"
            )
        group, tile_px, takes_part = self._tiling(tile_px)
        if not takes_part:
            return None
        if tile_px is None:
            return vae.encode(pixels.to(self.device, vae.dtype)).latent_dist.mode().float().cpu()
        return tiled_encode(vae, pixels, tile_px=tile_px, overlap_px=overlap_px, group=group).float().cpu()


def check_conditioning(model, request: SampleRequest) -> None:
    """Fail before sampling when the prompt embeddings or latent cannot feed this model."""
    check_latent(request.latent)
    text_dim = model.config.text_dim
    for name, embeddings in (("positive", request.positive), ("negative", request.negative)):
        for emb in embeddings:
            if emb.ndim != 2 or emb.shape[1] != text_dim:
                raise ValueError(
                    f"{name} conditioning has shape {list(emb.shape)} but this model takes text embeddings of width "
                    f"{text_dim}; encode the prompt with the text encoder that belongs to the model"
                )


def transformer_heads(path: str, vace_module: str | None = None) -> int:
    """The attention head count of a transformer file or folder, read from its config without loading weights."""
    with contextlib.ExitStack() as stack:
        model_class, config, _ = loaders.transformer_weight_source(path, vace_module, stack)
    default = inspect.signature(model_class.__init__).parameters["num_attention_heads"].default
    return int(config.get("num_attention_heads", default))
