"""Test utilities shared by unit and distributed tests: fp8 variants of a weight file, state comparison."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn


def write_fp8_variant(source, target, scaled: bool) -> None:
    """Write `source` with every 2-D weight in fp8 (ComfyUI "scaled fp8" with per-layer scale_weight if `scaled`)."""
    variant = {}
    for name, tensor in load_file(source).items():
        if tensor.dim() == 2 and name.endswith(".weight"):
            scale = tensor.abs().max() / 448.0 if scaled else None
            variant[name] = (tensor / scale if scaled else tensor).to(FP8)
            if scaled:
                variant[name[: -len("weight")] + "scale_weight"] = scale.reshape(1)
        else:
            variant[name] = tensor
    if scaled:
        variant["scaled_fp8"] = torch.empty(0, dtype=FP8)
    with safe_open(source, "pt") as handle:
        save_file(variant, target, metadata=handle.metadata())


def assert_same_state(label: str, first: torch.nn.Module, second: torch.nn.Module) -> None:
    """Both modules hold exactly the same tensors under the same names."""
    first_state, second_state = first.state_dict(), second.state_dict()
    assert first_state.keys() == second_state.keys(), label
    for name, tensor in first_state.items():
        assert torch.equal(tensor, second_state[name]), f"{label}: {name} differs"
