"""VACE files as the loader sees them: kinds read from the header alone, and a VACE module whose width does not
fit the base model refused in one line before any weight is read."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from wanmesh.parallel.weights.checkpoint import ModelFileError
from wanmesh.parallel.weights.detect import safetensors_kind
from wanmesh.parallel.weights.loaders import load_transformer


def test_kinds_come_from_the_header(tiny_models, tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 16)
    assert safetensors_kind(str(tiny_models["vace_module"])) == "vace_module"
    assert safetensors_kind(str(tiny_models["t2v"])) == "wan_t2v"
    assert safetensors_kind(str(tiny_models["vace"])) == "wan_vace"
    assert safetensors_kind(str(garbage)) == "unknown"


def test_a_vace_module_of_another_width_is_one_line_naming_both_widths(tiny_models, tmp_path):
    wide = tmp_path / "wide_vace_module.safetensors"
    save_file({"vace_patch_embedding.weight": torch.zeros(256, 96, 1, 2, 2),
               "vace_patch_embedding.bias": torch.zeros(256),
               "vace_blocks.0.after_proj.weight": torch.zeros(256, 256)}, str(wide))
    with pytest.raises(ModelFileError) as error:
        load_transformer(str(tiny_models["t2v"]), vace_module=str(wide))
    message = str(error.value)
    assert "\n" not in message and "width 256" in message and "width 128" in message
