"""Test utilities shared by unit, distributed and ComfyUI tests: fp8 variants of a weight file, state comparison, and
the relative error with its half-precision bounds."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
# Half-precision bounds (relative, whole latent): against the fp32 result of the same inputs on one device (bf16 has 8
# bits of mantissa, fp16 11); a layout against world 1 in the same dtype (they differ only by the order of reductions);
# and the least error a half run shows against fp32, so a run that silently computed in fp32 fails.
DTYPE_TOLERANCE = {"bf16": 6e-2, "fp16": 1e-2}
LAYOUT_TOLERANCE = {"bf16": 4e-2, "fp16": 6e-3}
MIN_HALF_ERROR = 1e-4


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """||value - reference|| / ||reference||, in fp32."""
    return float((value.float() - reference.float()).norm() / reference.float().norm())


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
