"""ComfyUI's patches on the WanMesh MODEL, without ComfyUI: weight patches become a LoRA file the workers read
(factors unchanged, content-named), patches the pool cannot apply are refused in one line, skip-layer block
replacements are recognised by what they return, and a skipped block is bypassed with its hooks kept."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from wanmesh.nodes.bridge import pool_patches as pp
from wanmesh.parallel.sampling.forward import skipping_blocks

SHAPES = {"blocks.0.self_attn.q.weight": (8, 6), "blocks.0.self_attn.q.bias": (8,), "blocks.0.norm3.weight": (6,)}


class LoRAAdapter:  # ComfyUI's class name; its weights tuple as comfy.weight_adapter.lora holds it
    def __init__(self, up, down, alpha=None, mid=None, dora=None):
        self.weights = (up, down, alpha, mid, dora, None)


def patches(up_rows: int = 8, nan: bool = False) -> dict:
    up, down = torch.randn(up_rows, 2), torch.randn(2, 6)
    if nan:
        up[0, 0] = float("inf")
    return {"diffusion_model.blocks.0.self_attn.q.weight": LoRAAdapter(up, down, 4.0),
            "diffusion_model.blocks.0.self_attn.q.bias": ("diff", (torch.randn(8),)),
            "diffusion_model.blocks.0.norm3.weight": ("diff", (torch.randn(6),)),
            "text_encoders.t5.layer.weight": LoRAAdapter(torch.randn(4, 2), torch.randn(2, 4))}


def test_patches_become_a_lora_file_in_original_layout(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WANMESH_CACHE", str(tmp_path))
    given = patches()
    tensors, added = pp.lora_factors(given, 1.0, SHAPES, "x.safetensors")
    assert sorted(added) == sorted(key for key in given if key.startswith("diffusion_model."))
    path = pp.write_factors(tensors)
    assert pp.write_factors(tensors) == path, "the same factors name the same file"
    stored = load_file(str(path))
    adapter = given["diffusion_model.blocks.0.self_attn.q.weight"]
    assert torch.equal(stored["diffusion_model.blocks.0.self_attn.q.lora_up.weight"], adapter.weights[0])
    assert stored["diffusion_model.blocks.0.self_attn.q.alpha"].item() == 4.0
    assert set(stored) >= {"diffusion_model.blocks.0.self_attn.q.diff_b", "diffusion_model.blocks.0.norm3.diff"}


@pytest.mark.parametrize("bad, words", [
    (dict(up_rows=16), "for another model"), (dict(nan=True), "NaN or Inf")])
def test_a_bad_lora_is_one_line_naming_the_file(bad, words) -> None:
    with pytest.raises(ValueError, match=words) as error:
        pp.lora_factors(patches(**bad), 1.0, SHAPES, "bad.safetensors")
    assert "bad.safetensors" in str(error.value) and "\n" not in str(error.value)


def test_patches_the_pool_cannot_apply_are_refused() -> None:
    loha = {"diffusion_model.blocks.0.self_attn.q.weight": type("LoHaAdapter", (), {"weights": ()})()}
    with pytest.raises(ValueError, match="LoHaAdapter"):
        pp.lora_factors(loha, 1.0, SHAPES, "loha.safetensors")
    dora = {"diffusion_model.blocks.0.self_attn.q.weight": LoRAAdapter(torch.ones(8, 2), torch.ones(2, 6),
                                                                        dora=torch.ones(8))}
    with pytest.raises(ValueError, match="DoRA"):
        pp.lora_factors(dora, 1.0, SHAPES, "dora.safetensors")
    with pytest.raises(ValueError, match="model merging"):
        pp.lora_factors(patches(), 0.5, SHAPES, "merge")


class MultiTalkCrossAttnPatch:  # ComfyUI's class names: the patch objects WanInfiniteTalkToVideo sets
    def __call__(self, kwargs):
        return kwargs["x"]


class Patcher:  # the parts of a ModelPatcher check_model_patches reads
    def __init__(self, patches=None, injections=None):
        self.object_patches, self.injections = {}, injections or {}
        self.model_options = {"transformer_options": {"patches": patches or {}}}


@pytest.mark.parametrize("patcher, words", [
    (Patcher({"attn2_patch": [MultiTalkCrossAttnPatch()]}), ("WanInfiniteTalkToVideo", "attn2_patch")),
    (Patcher({"double_block": [type("WanUni3CCnetPatch", (), {})()]}), ("WanUni3CControlnetApply", "double_block")),
    (Patcher({"attn1_patch": [lambda kwargs: kwargs["x"]]}), ("<lambda>", "attn1_patch")),
    (Patcher(injections={"bypass_lora": [object()]}), ("LoraLoaderBypass", "LoraLoaderModelOnly")),
])
def test_code_run_inside_the_blocks_is_refused_naming_its_node(patcher, words) -> None:
    """Model patches called inside the blocks (InfiniteTalk, Uni3C) and forward injections (bypass LoRAs) cannot
    run in the workers: refused in one line naming the node, never dropped."""
    with pytest.raises(ValueError) as refused:
        pp.check_model_patches(patcher)
    message = str(refused.value)
    assert all(word in message for word in words) and "\n" not in message, message
    pp.check_model_patches(Patcher({"attn2_patch": []}))  # an emptied patch list changes nothing
    pp.check_model_patches(Patcher({"input_block_patch": [lambda h, options: h]}))  # a UNet's: native Wan ignores it


def test_identity_block_replacements_skip_blocks_and_others_are_refused() -> None:
    def skip(args, extra):
        return args

    def runs_block(args, extra):
        return extra["original_block"](args)

    options = {"patches_replace": {"dit": {("double_block", 3): skip, ("single_block", 1): runs_block}}}
    assert pp.skipped_blocks(options) == [3]
    with pytest.raises(ValueError, match="^test_identity_block_replacements.*: the WanMesh MODEL can skip"):
        pp.skipped_blocks({"patches_replace": {"dit": {("double_block", 0): runs_block}}})
    with pytest.raises(ValueError, match="ScaleROPE"):
        pp.skipped_blocks({"rope_options": {"scale_x": 2.0}})


class Block(torch.nn.Module):
    def forward(self, hidden_states, temb):
        return hidden_states * 2 + temb


def test_a_skipped_block_returns_its_input_and_keeps_its_hooks() -> None:
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([Block(), Block()])
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    x = torch.ones(2)
    with skipping_blocks(model, [0, 7]):  # 7: past the last block, skips nothing (as natively)
        assert torch.equal(model.blocks[0](x, 1.0), x)
        assert torch.equal(model.blocks[1](x, 1.0), x * 3)
    assert len(seen) == 1, "the hook on the skipped block did not run"
    assert torch.equal(model.blocks[0](x, 1.0), x * 3), "the block was not restored"
