"""The single-device engine: owns the models loaded on one device and runs requests on them.

Every worker of the pool holds one Engine; parallel execution is applied to it from outside. Models stay
resident between requests, keyed by kind, file and options, until unloaded.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import loaders
from .sampling import Cancelled, SampleRequest, sample
from .video import check_latent, frames_to_pixels, pixels_to_frames

__all__ = ["Engine", "Cancelled", "SampleRequest", "resolve_dtype", "DTYPES"]

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
        self.parallel = parallel
        self._models: dict[str, object] = {}

    # -- loading ---------------------------------------------------------------------------------------

    def _load(self, key: str, make: Callable[[], object]) -> str:
        if key not in self._models:
            self._models[key] = make()
        return key

    def load_model(self, path: str, *, vace_module: str | None = None, dtype: str = "auto") -> str:
        torch_dtype = resolve_dtype(dtype, self.device)
        key = f"model|{path}|{vace_module or ''}|{torch_dtype}"
        return self._load(
            key,
            lambda: loaders.load_transformer(path, vace_module=vace_module, dtype=torch_dtype, device=self.device),
        )

    def load_vae(self, path: str, *, dtype: str = "auto") -> str:
        torch_dtype = resolve_dtype(dtype, self.device)
        return self._load(f"vae|{path}|{torch_dtype}", lambda: loaders.load_vae(path, dtype=torch_dtype, device=self.device))

    def load_text_encoder(self, path: str, *, dtype: str = "auto") -> str:
        torch_dtype = resolve_dtype(dtype, self.device)
        return self._load(
            f"text|{path}|{torch_dtype}",
            lambda: loaders.load_text_encoder(path, dtype=torch_dtype, device=self.device),
        )

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
        return sample(model, request, device=self.device, dtype=dtype, progress=progress, should_stop=should_stop)

    @torch.no_grad()
    def decode(self, handle: str, latents: torch.Tensor) -> torch.Tensor:
        """Raw latents [B, 16, T, h, w] -> frames [B*F, H, W, 3] in 0..1."""
        vae = self._get(handle, "vae")
        if latents.ndim != 5 or latents.shape[1] != vae.config.z_dim:
            raise ValueError(f"expected Wan latents [B, {vae.config.z_dim}, T, h, w], got shape {list(latents.shape)}")
        pixels = vae.decode(latents.to(self.device, vae.dtype), return_dict=False)[0]
        return pixels_to_frames(pixels)

    @torch.no_grad()
    def encode(self, handle: str, frames: torch.Tensor) -> torch.Tensor:
        """Frames [F, H, W, 3] in 0..1 -> raw latents [1, 16, T, h, w] (the posterior mode, as Wan uses)."""
        vae = self._get(handle, "vae")
        pixels = frames_to_pixels(frames)
        count, height, width = pixels.shape[2:]
        if (count - 1) % 4 or height % 8 or width % 8:
            raise ValueError(
                f"cannot encode {count} frames of {width}x{height}: the Wan VAE needs 4k+1 frames and sides that "
                "are multiples of 8"
            )
        posterior = vae.encode(pixels.to(self.device, vae.dtype)).latent_dist
        return posterior.mode().float().cpu()


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
