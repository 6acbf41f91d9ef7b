"""The Wan 2.2 VAE (TI2V 5B's 48-channel VAE) in its original key layout: recognising it, the name map onto diffusers'
``AutoencoderKLWan`` (``is_residual=True``), the config inferred from shapes and the latent statistics; runs in the
workers (loading) and in the CLI process and tests (the tiny writer). No model library is imported here.

The original layout (``wan2.2_vae.safetensors``, what ComfyUI's ``comfy/ldm/wan/vae2_2.py`` loads) nests each level's
blocks: ``encoder.downsamples.L.downsamples.J`` (``num_res_blocks`` residual blocks, then the resample) and
``decoder.upsamples.L.upsamples.J`` (``num_res_blocks + 1`` residual blocks, then the resample); the Wan 2.1 VAE keeps
them in one flat ``encoder.downsamples.N`` sequence. Pixels enter and leave the VAE as 2x2 patches (3 x 2 x 2 = 12
channels), so the spatial factor is 2 x 2**3 = 16; the temporal factor stays 4.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..config import WAN22_LATENT_CHANNELS, WAN22_LATENTS_MEAN, WAN22_LATENTS_STD
from .checkpoint import ModelFileError

__all__ = ["WAN22_LATENT_CHANNELS", "WAN22_LATENTS_MEAN", "WAN22_LATENTS_STD", "convert_wan22_vae_keys",
           "infer_wan22_vae_config", "is_wan22_vae"]

# The latent facts (48 channels; the per-channel mean / std of the raw latents, as released with the VAE: ComfyUI's
# latent_formats.Wan22, diffusers' Wan2.2-TI2V-5B config) live in config.py, shared with the sampler; here they become
# the loaded VAE's config (diffusers' AutoencoderKLWan defaults hold only the Wan 2.1 values).
WAN22_PATCH = 2  # pixels go in and out as 2x2 patches
PIXEL_CHANNELS = 3
WAN22_IO_CHANNELS = PIXEL_CHANNELS * WAN22_PATCH * WAN22_PATCH  # 12: the encoder's input, the decoder's output
# ComfyUI tells the Wan 2.2 VAE from the 2.1 one by this key (comfy/sd.py); the 2.1 layout has no nested upsamples.
WAN22_MARKER_KEY = "decoder.upsamples.0.upsamples.0.residual.2.weight"


def is_wan22_vae(keys: Iterable[str]) -> bool:
    """Whether unprefixed original-layout VAE keys are the Wan 2.2 VAE's (nested levels), as ComfyUI decides."""
    return WAN22_MARKER_KEY in set(keys)


# -- name map: original layout -> diffusers ------------------------------------------------------------------------
# Written by hand: diffusers' single-file converter (`convert_wan_vae_to_diffusers`) knows only the flat Wan 2.1
# layout, and its Wan 2.2 mapping lives in a conversion script (scripts/convert_wan_to_diffusers.py), not the library.

FIXED_MODULES = {
    "conv1": "quant_conv", "conv2": "post_quant_conv",
    "encoder.conv1": "encoder.conv_in", "decoder.conv1": "decoder.conv_in",
    "encoder.head.0": "encoder.norm_out", "encoder.head.2": "encoder.conv_out",
    "decoder.head.0": "decoder.norm_out", "decoder.head.2": "decoder.conv_out",
}
RESIDUAL_PARTS = {"residual.0": "norm1", "residual.2": "conv1", "residual.3": "norm2", "residual.6": "conv2",
                  "shortcut": "conv_shortcut"}
SAMPLER_PARTS = ("resample.1", "time_conv")
MIDDLE = re.compile(r"^(encoder|decoder)\.middle\.([012])\.(.+)$")
# Original level blocks -> (diffusers' block list, the name of its resample module).
LEVEL_BLOCKS = {
    re.compile(r"^encoder\.downsamples\.(\d+)\.downsamples\.(\d+)\.(.+)$"): ("encoder.down_blocks", "downsampler"),
    re.compile(r"^decoder\.upsamples\.(\d+)\.upsamples\.(\d+)\.(.+)$"): ("decoder.up_blocks", "upsampler"),
}


def _residual_part(part: str) -> str | None:
    """A residual block's own module name in diffusers (``residual.2`` -> ``conv1``), None when not one of them."""
    return RESIDUAL_PARTS.get(part)


def _middle_module(side: str, index: str, part: str) -> str | None:
    if index == "1":  # the middle attention block keeps its module names
        return f"{side}.mid_block.attentions.0.{part}"
    residual = _residual_part(part)
    return residual and f"{side}.mid_block.resnets.{int(index) // 2}.{residual}"


def _level_module(blocks: str, sampler: str, level: str, block: str, part: str) -> str | None:
    if part in SAMPLER_PARTS:
        return f"{blocks}.{level}.{sampler}.{part}"
    residual = _residual_part(part)
    return residual and f"{blocks}.{level}.resnets.{block}.{residual}"


def wan22_vae_module(module: str) -> str | None:
    """The diffusers module path of an original-layout module path, None for a path the layout does not have."""
    if module in FIXED_MODULES:
        return FIXED_MODULES[module]
    if match := MIDDLE.match(module):
        return _middle_module(*match.groups())
    for pattern, names in LEVEL_BLOCKS.items():
        if match := pattern.match(module):
            return _level_module(*names, *match.groups())
    return None


def convert_wan22_vae_keys(checkpoint: Mapping[str, object]) -> dict[str, object]:
    """Rename original Wan 2.2 VAE keys to diffusers' names, values untouched (a pure renamer for ``rename_map``).
    Keys the layout does not have keep their name, so the loader names them as unexpected tensors."""
    converted = {}
    for key, value in checkpoint.items():
        module, _, parameter = key.rpartition(".")
        renamed = wan22_vae_module(module)
        name = f"{renamed}.{parameter}" if renamed else key
        if name in converted:
            raise ModelFileError(f"This Wan 2.2 VAE file holds two tensors for '{name}' (one is '{key}'); a file "
                                 f"holds each weight once.")
        converted[name] = value
    return converted


# -- config from shapes --------------------------------------------------------------------------------------------


def _shape(shapes: Mapping[str, tuple[int, ...]], key: str) -> tuple[int, ...]:
    if key not in shapes:
        raise ModelFileError(f"This Wan 2.2 VAE file lacks the tensor '{key}'; a complete wan2.2_vae.safetensors "
                             f"has it.")
    return tuple(shapes[key])


def _indices(shapes: Mapping[str, tuple[int, ...]], prefix: str) -> set[int]:
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)\.")
    return {int(match.group(1)) for key in shapes if (match := pattern.match(key))}


def _residual_count(shapes: Mapping[str, tuple[int, ...]], level_prefix: str) -> int:
    indices = _indices(shapes, level_prefix)
    return len({index for index in indices if f"{level_prefix}{index}.residual.2.weight" in shapes})


def _check_channels(z_dim: int, in_channels: int, out_channels: int) -> None:
    if z_dim != WAN22_LATENT_CHANNELS:
        raise ModelFileError(f"This VAE in the Wan 2.2 layout has {z_dim} latent channels; only the Wan 2.2 VAE's "
                             f"{WAN22_LATENT_CHANNELS} are supported.")
    if (in_channels, out_channels) != (WAN22_IO_CHANNELS, WAN22_IO_CHANNELS):
        raise ModelFileError(f"This Wan 2.2 VAE takes {in_channels} and gives {out_channels} pixel channels; expected "
                             f"{WAN22_IO_CHANNELS} (RGB in 2x2 patches).")


def _levels(shapes: Mapping[str, tuple[int, ...]], base_dim: int) -> tuple[list[int], int, list[bool]]:
    """(width multiple per level, residual blocks per encoder level, which resamples halve the frames) of the
    encoder; the decoder mirrors it (one residual block more per level), as the model class builds it."""
    levels = len(_indices(shapes, "encoder.downsamples."))
    res_blocks = _residual_count(shapes, "encoder.downsamples.0.downsamples.")
    if levels < 1 or res_blocks < 1:
        raise ModelFileError(f"This Wan 2.2 VAE has {levels} encoder levels of {res_blocks} residual blocks; expected "
                             f"at least one of each (wan2.2_vae.safetensors has 4 levels of 2).")
    dim_mult = [_shape(shapes, f"encoder.downsamples.{level}.downsamples.0.residual.2.weight")[0] // base_dim
                for level in range(levels)]
    temporal = [f"encoder.downsamples.{level}.downsamples.{res_blocks}.time_conv.weight" in shapes
                for level in range(levels - 1)]
    return dim_mult, res_blocks, temporal


def infer_wan22_vae_config(shapes: Mapping[str, tuple[int, ...]]) -> dict:
    """diffusers ``AutoencoderKLWan`` kwargs of a Wan 2.2 VAE from its original-layout shapes (unprefixed keys):
    widths, levels and residual blocks from the tensors, the 2x2 patches, factors and the 48 latent statistics."""
    base_dim, in_channels = _shape(shapes, "encoder.conv1.weight")[:2]
    z_dim = _shape(shapes, "conv2.weight")[0]
    _check_channels(z_dim, in_channels, _shape(shapes, "decoder.head.2.weight")[0])
    dim_mult, res_blocks, temporal = _levels(shapes, base_dim)
    return {
        "base_dim": base_dim, "decoder_base_dim": _shape(shapes, "decoder.head.0.gamma")[0], "z_dim": z_dim,
        "dim_mult": dim_mult, "num_res_blocks": res_blocks, "attn_scales": [], "temperal_downsample": temporal,
        "is_residual": True, "in_channels": in_channels, "out_channels": in_channels, "patch_size": WAN22_PATCH,
        "scale_factor_temporal": 2 ** sum(temporal), "scale_factor_spatial": WAN22_PATCH * 2 ** len(temporal),
        "latents_mean": list(WAN22_LATENTS_MEAN), "latents_std": list(WAN22_LATENTS_STD),
    }


def check_wan22_folder_config(config: Mapping, folder: Path) -> dict:
    """A diffusers-folder config of the 48-channel VAE, with its spatial factor checked against its structure (2x2
    patches, one halving per level but the last); a config without the factor or the latent statistics gets them."""
    patch = config.get("patch_size") or 1
    spatial = patch * 2 ** (len(config.get("dim_mult", [1, 2, 4, 4])) - 1)
    if not config.get("is_residual") or patch != WAN22_PATCH:
        raise ModelFileError(f"{folder}/config.json has {config.get('z_dim')} latent channels but is not the Wan 2.2 "
                             f"VAE (is_residual true, patch_size {WAN22_PATCH}); use the Wan 2.2 VAE's own config.")
    if config.get("scale_factor_spatial", spatial) != spatial:
        raise ModelFileError(f"{folder}/config.json says scale_factor_spatial {config['scale_factor_spatial']}, but "
                             f"its structure gives {spatial}; fix the config (the Wan 2.2 VAE's is {spatial}).")
    return {"latents_mean": list(WAN22_LATENTS_MEAN), "latents_std": list(WAN22_LATENTS_STD), **config,
            "scale_factor_spatial": spatial}
