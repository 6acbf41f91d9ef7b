"""A tiny random Wan 2.2 VAE (48 latent channels, 2x2 pixel patches, 16x16 spatial and 4x temporal compression) in
the original key layout of ``wan2.2_vae.safetensors``; runs in the CLI process (``make-tiny``) and tests.

The file holds the layout ComfyUI detects as the Wan 2.2 VAE (nested ``decoder.upsamples.L.upsamples.J`` blocks, a
48-channel ``conv2``, 12-channel encoder input and decoder head), at small widths: encoder 8, decoder 16 (the release
has 160 and 256). ComfyUI's own loader builds every Wan 2.2 VAE at the release widths, depths and channel multipliers
whatever the file holds (``comfy/sd.py``), so only WanMesh loads this file as it is. The smallest Wan 2.2 VAE native
``VAELoader`` loads is therefore release-sized (705M parameters): ``write_native_vae22`` writes that twin on request
(``wanmesh make-tiny --native-vae22``; bf16, 1.4 GB, drawn tensor by tensor so writing it holds one copy). The
original names are generated from the config and proven by mapping them through ``models/vae22.py``'s name map back
onto exactly the diffusers model's state-dict keys (diffusers' single-file converter knows only the 2.1 layout).
Written atomically, deterministic.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLWan

from ..weights.vae22_keys import (
    WAN22_IO_CHANNELS,
    WAN22_LATENT_CHANNELS,
    WAN22_LATENTS_MEAN,
    WAN22_LATENTS_STD,
    WAN22_PATCH,
    convert_wan22_vae_keys,
)
from ..tensor_files import save_tensors_atomic
from .files import TINY_FILES

__all__ = ["NATIVE_VAE22_FILE", "NATIVE_VAE22_WIDTHS", "TINY_VAE22", "TINY_VAE22_FILE", "VAE22_SEED",
           "build_tiny_vae22", "original_vae22_names", "write_native_vae22", "write_tiny_vae22"]

TINY_VAE22_FILE = TINY_FILES["vae22"]  # relative to a models tree's root
VAE22_SEED = 20250202
TINY_VAE22 = dict(
    base_dim=8, decoder_base_dim=16, z_dim=WAN22_LATENT_CHANNELS, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
    attn_scales=[], temperal_downsample=[False, True, True], is_residual=True, in_channels=WAN22_IO_CHANNELS,
    out_channels=WAN22_IO_CHANNELS, patch_size=WAN22_PATCH, scale_factor_temporal=4, scale_factor_spatial=16,
    latents_mean=list(WAN22_LATENTS_MEAN), latents_std=list(WAN22_LATENTS_STD),
)
NATIVE_VAE22_WIDTHS = dict(base_dim=160, decoder_base_dim=256)  # what comfy/sd.py builds for every Wan 2.2 VAE
NATIVE_VAE22_FILE = "vae/wan22_native_vae.safetensors"  # the release-width twin native VAELoader reads


def _pairs(*names: str) -> list[str]:
    return [f"{name}.{suffix}" for name in names for suffix in ("weight", "bias")]


def _residual_names(prefix: str, in_dim: int, out_dim: int) -> list[str]:
    names = [f"{prefix}.residual.0.gamma", f"{prefix}.residual.3.gamma"] + _pairs(f"{prefix}.residual.2",
                                                                                  f"{prefix}.residual.6")
    return names + (_pairs(f"{prefix}.shortcut") if in_dim != out_dim else [])


def _middle_names(prefix: str) -> list[str]:
    attention = [f"{prefix}.middle.1.norm.gamma"] + _pairs(f"{prefix}.middle.1.to_qkv", f"{prefix}.middle.1.proj")
    return _residual_names(f"{prefix}.middle.0", 1, 1) + attention + _residual_names(f"{prefix}.middle.2", 1, 1)


def _level_names(prefix: str, dims: list[int], blocks: int, temporal: list[bool]) -> list[str]:
    """One stack's nested levels: ``prefix.L.<sub>.J`` residual blocks, then the resample of every level but the
    last (with a temporal conv where the level changes the frame rate)."""
    sub = prefix.rsplit(".", 1)[1]  # "downsamples" / "upsamples": each level's block list has the stack's name
    names = []
    for level, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
        for block in range(blocks):
            names += _residual_names(f"{prefix}.{level}.{sub}.{block}", in_dim if block == 0 else out_dim, out_dim)
        if level != len(dims) - 2:
            resample = f"{prefix}.{level}.{sub}.{blocks}"
            names += _pairs(f"{resample}.resample.1") + (_pairs(f"{resample}.time_conv") if temporal[level] else [])
    return names


def original_vae22_names(config: dict) -> list[str]:
    """Original Wan 2.2 VAE key names for an ``AutoencoderKLWan`` config of the 2.2 kind."""
    mult, blocks, temporal = config["dim_mult"], config["num_res_blocks"], config["temperal_downsample"]
    decoder_base = config.get("decoder_base_dim") or config["base_dim"]
    names = _pairs("encoder.conv1", "conv1", "conv2", "decoder.conv1", "encoder.head.2", "decoder.head.2")
    names += ["encoder.head.0.gamma", "decoder.head.0.gamma"] + _middle_names("encoder") + _middle_names("decoder")
    names += _level_names("encoder.downsamples", [config["base_dim"] * m for m in [1] + mult], blocks, temporal)
    names += _level_names("decoder.upsamples", [decoder_base * m for m in [mult[-1]] + mult[::-1]], blocks + 1,
                          temporal[::-1])
    return names


def build_tiny_vae22(seed: int = VAE22_SEED, **widths: int) -> AutoencoderKLWan:
    """The tiny Wan 2.2 VAE with seeded random weights (``widths``: ``base_dim`` / ``decoder_base_dim`` to override)."""
    from .models import randomise_  # here, not at the top: tiny/models.py may import this module for make-tiny

    vae = AutoencoderKLWan(**{**TINY_VAE22, **widths})
    randomise_(vae, seed)
    return vae.eval().requires_grad_(False)


def original_vae22_state(vae: AutoencoderKLWan) -> dict[str, torch.Tensor]:
    """The model's weights under their original Wan 2.2 names, the layout proven against the model's keys."""
    from .models import original_state_dict

    return original_state_dict(vae, original_vae22_names(dict(vae.config)), convert_wan22_vae_keys)


def write_tiny_vae22(root: str | Path, seed: int = VAE22_SEED, **widths: int) -> Path:
    """Write the tiny Wan 2.2 VAE to ``root / TINY_VAE22_FILE`` (atomically) and return that path."""
    return save_tensors_atomic(original_vae22_state(build_tiny_vae22(seed, **widths)), Path(root) / TINY_VAE22_FILE)


def write_native_vae22(root: str | Path, seed: int = VAE22_SEED) -> Path:
    """Write the Wan 2.2 VAE at the widths ComfyUI builds (``NATIVE_VAE22_WIDTHS``) to ``root / NATIVE_VAE22_FILE``
    in bf16 and return that path. Its values are ``build_tiny_vae22(seed, **NATIVE_VAE22_WIDTHS)``'s rounded to
    bf16 (the same draws in the same order), drawn one tensor at a time on a model skeleton without storage."""
    from .models import _random_like, diffusers_to_original

    with torch.device("meta"):
        skeleton = AutoencoderKLWan(**{**TINY_VAE22, **NATIVE_VAE22_WIDTHS})
    names = diffusers_to_original(original_vae22_names(dict(skeleton.config)), convert_wan22_vae_keys, skeleton)
    generator = torch.Generator().manual_seed(seed)
    state = {names[name]: _random_like(name, parameter.shape, generator).to(torch.bfloat16)
             for name, parameter in sorted(skeleton.named_parameters())}
    return save_tensors_atomic(state, Path(root) / NATIVE_VAE22_FILE)
