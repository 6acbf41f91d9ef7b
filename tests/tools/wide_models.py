"""Tiny Wan T2V model files made big by a wide feed-forward layer, for memory tests; runs in the test process.

A model's resident size is what memory tests measure, and the tiny T2V file (a few MB) is lost in the noise
of a worker process (hundreds of MB). These files keep the tiny model's shape except ``ffn_dim``, so they
load, sample and decode like it (the loader reads ``ffn_dim`` from the weights' shapes) but weigh tens of MB.
Each seed gives other weights: different files, different resident models.
"""

from __future__ import annotations

from pathlib import Path

from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors.torch import save_file

from wanmesh.parallel.tiny.models import TINY_TRANSFORMER, original_state_dict, original_transformer_names, randomise_

MIB = 2**20


def wide_ffn_dim(target_mib: float) -> int:
    """The ``ffn_dim`` (a multiple of 256) that makes a float32 tiny T2V file of about ``target_mib`` MiB: the
    feed-forward weights (2 x dim x ffn_dim per layer) are nearly all of it."""
    width = TINY_TRANSFORMER["num_attention_heads"] * TINY_TRANSFORMER["attention_head_dim"]
    per_ffn_unit = 2 * width * TINY_TRANSFORMER["num_layers"] * 4  # bytes per unit of ffn_dim
    return max(256, round(target_mib * MIB / per_ffn_unit / 256) * 256)


def write_wide_t2v(path: str | Path, *, seed: int, ffn_dim: int) -> Path:
    """Write a tiny T2V model with ``ffn_dim`` and seeded random weights, in the original (ComfyUI) key layout."""
    config = dict(TINY_TRANSFORMER, ffn_dim=ffn_dim)
    model = WanTransformer3DModel(**config)
    randomise_(model, seed)
    state = original_state_dict(model, original_transformer_names(config), convert_wan_transformer_to_diffusers)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, path, metadata={"num_heads": str(config["num_attention_heads"])})
    return path
