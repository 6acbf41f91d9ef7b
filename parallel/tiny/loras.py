"""Tiny LoRA files for the tiny T2V model, one per format users have (ComfyUI / original keys, PEFT / diffusers,
kohya, full ``diff`` / ``diff_b`` deltas); written by ``wanmesh make-tiny`` (CLI process) for tests and examples.

Rank 4, deterministic seed. Every linear layer of every block's attention and FFN is targeted; the formats use
different factors and scales (alpha 8 in the ComfyUI and kohya files, no alpha, i.e. scale 1, in PEFT).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = ["LORA_FORMATS", "TINY_LORA_RANK", "lora_targets", "make_tiny_loras"]

TINY_LORA_RANK = 4
TINY_LORA_ALPHA = 8.0
TINY_LORA_SEED = 20250214
LORA_FORMATS = ("comfy", "peft", "kohya", "diff")
_LAYER_SUFFIXES = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
                   "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")


def lora_targets(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, int]]:
    """Original-layout layer name -> (out, in) of each block linear a tiny LoRA targets, from a model's shapes."""
    return {key.removesuffix(".weight"): tuple(shape) for key, shape in shapes.items()
            if key.startswith("blocks.") and key.endswith(".weight") and len(shape) == 2
            and key.removesuffix(".weight").split(".", 2)[2] in _LAYER_SUFFIXES}


def _factors(targets, generator: torch.Generator, scale: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {name: (torch.randn(out, TINY_LORA_RANK, generator=generator) * scale,
                   torch.randn(TINY_LORA_RANK, inp, generator=generator) * scale)
            for name, (out, inp) in sorted(targets.items())}


def _comfy(targets, generator) -> dict[str, torch.Tensor]:
    state = {}
    for name, (up, down) in _factors(targets, generator, 0.1).items():
        state[f"diffusion_model.{name}.lora_up.weight"] = up
        state[f"diffusion_model.{name}.lora_down.weight"] = down
        state[f"diffusion_model.{name}.alpha"] = torch.tensor(TINY_LORA_ALPHA)
    return state


def _peft(targets, generator, to_diffusers) -> dict[str, torch.Tensor]:
    state = {}
    for name, (up, down) in _factors(targets, generator, 0.15).items():
        state[f"transformer.{to_diffusers[name]}.lora_B.weight"] = up
        state[f"transformer.{to_diffusers[name]}.lora_A.weight"] = down
    return state


def _kohya(targets, generator) -> dict[str, torch.Tensor]:
    state = {}
    for name, (up, down) in _factors(targets, generator, 0.1).items():
        flat = "lora_unet_" + name.replace(".", "_")
        state[f"{flat}.lora_up.weight"] = up
        state[f"{flat}.lora_down.weight"] = down
        state[f"{flat}.alpha"] = torch.tensor(TINY_LORA_ALPHA / 2)
    return state


def _diff(targets, generator) -> dict[str, torch.Tensor]:
    state = {}
    for name, (out, inp) in sorted(targets.items()):
        state[f"diffusion_model.{name}.diff"] = torch.randn(out, inp, generator=generator) * 0.02
        state[f"diffusion_model.{name}.diff_b"] = torch.randn(out, generator=generator) * 0.02
    return state


def make_tiny_loras(directory: str | Path, shapes: dict[str, tuple[int, ...]], to_diffusers: dict[str, str]) -> dict:
    """Write ``loras/wan_tiny_lora_{format}.safetensors`` for a model with these original-layout ``shapes``;
    ``to_diffusers`` maps original layer names to diffusers module paths (for the PEFT file)."""
    targets = lora_targets(shapes)
    generator = torch.Generator().manual_seed(TINY_LORA_SEED)
    states = {"comfy": _comfy(targets, generator), "peft": _peft(targets, generator, to_diffusers),
              "kohya": _kohya(targets, generator), "diff": _diff(targets, generator)}
    paths = {}
    for name, state in states.items():
        path = Path(directory) / "loras" / f"wan_tiny_lora_{name}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({key: value.contiguous() for key, value in state.items()}, str(path))
        paths[f"lora_{name}"] = path
    return paths
