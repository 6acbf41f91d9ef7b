"""The tensor-parallel plan, degree checks and sharded loading, without processes.

Sharded loading needs no communication, so a rank's shard is loaded here in-process (rank 1 of 2) for
every accepted file format and compared with slices of the single-device model; a spy on the checkpoint
reader proves that no sharded tensor is ever read whole.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

from checks import write_fp8_variant
from wanmesh.parallel.weights import checkpoint
from wanmesh.parallel.weights.quantized import read_weights
from wanmesh.parallel.weights.loaders import load_transformer, transformer_weight_source
from wanmesh.parallel.weights.sharded import load_transformer_shard, weight_bytes
from wanmesh.parallel.distributed.tensor_parallel import (
    apply_tensor_parallel,
    check_tp_degree,
    shard_index,
    tensor_parallel_plan,
)



def _expected_block_styles(prefix: str) -> dict[str, str]:
    styles = {}
    for attention in ("attn1", "attn2"):
        styles.update({f"{prefix}.{attention}.{name}": "column" for name in ("to_q", "to_k", "to_v")})
        styles[f"{prefix}.{attention}.to_out.0"] = "row"
        styles.update({f"{prefix}.{attention}.{name}": "norm" for name in ("norm_q", "norm_k")})
    return {**styles, f"{prefix}.ffn.net.0.proj": "column", f"{prefix}.ffn.net.2": "row"}


def test_plan_covers_every_transformer_and_vace_block(tiny_reference):
    plan = tensor_parallel_plan(tiny_reference.vace)
    expected = {}
    for prefix in [f"blocks.{i}" for i in range(4)] + ["vace_blocks.0", "vace_blocks.1"]:
        expected.update(_expected_block_styles(prefix))
    assert plan.styles == expected
    assert len(plan.attention_modules) == 12


def test_plan_shards_weights_by_style_and_replicates_the_rest(tiny_reference):
    dims = tensor_parallel_plan(tiny_reference.vace).shard_dims()
    assert dims["blocks.1.attn2.to_k.weight"] == 0 and dims["blocks.1.attn2.to_k.bias"] == 0
    assert dims["vace_blocks.0.attn1.to_out.0.weight"] == 1
    assert dims["blocks.3.ffn.net.2.weight"] == 1 and dims["blocks.0.attn1.norm_q.weight"] == 0
    replicated = set(tiny_reference.vace.state_dict()) - set(dims)
    for name in ("blocks.0.attn1.to_out.0.bias", "blocks.0.ffn.net.2.bias", "patch_embedding.weight",
                 "vace_patch_embedding.weight", "proj_out.weight", "scale_shift_table", "blocks.0.norm2.weight",
                 "blocks.0.scale_shift_table", "vace_blocks.0.proj_in.weight", "vace_blocks.1.proj_out.weight",
                 "condition_embedder.time_proj.weight", "condition_embedder.text_embedder.linear_1.weight"):
        assert name in replicated, name


@pytest.mark.parametrize("heads, ffn_dim, tp", [(4, 256, 1), (4, 256, 2), (4, 256, 4), (40, 13824, 8), (12, 8960, 4)])
def test_tp_dividing_the_heads_is_accepted(heads, ffn_dim, tp):
    check_tp_degree(heads, ffn_dim, tp)


@pytest.mark.parametrize("heads, tp, valid", [(4, 3, "1, 2, 4"), (4, 8, "1, 2, 4"), (12, 8, "1, 2, 3, 4, 6, 12")])
def test_tp_not_dividing_the_heads_is_rejected_with_the_numbers(heads, tp, valid):
    with pytest.raises(ValueError) as error:
        check_tp_degree(heads, 8960, tp)
    message = str(error.value)
    assert f"tp={tp}" in message and f"{heads} attention heads" in message and valid in message


def test_bad_tp_is_rejected_before_any_weight_is_read(tiny_models, monkeypatch):
    reads = []
    original = checkpoint.CheckpointFile.raw
    monkeypatch.setattr(checkpoint.CheckpointFile, "raw", lambda self, *a, **k: reads.append(a) or original(self, *a, **k))
    with pytest.raises(ValueError, match="tp=3 does not divide the model's 4 attention heads"):
        load_transformer_shard(tiny_models["t2v"], tp_rank=0, tp_size=3, tp_group=None)
    assert reads == []


def test_shard_blocks_tile_the_tensor():
    tensor = torch.arange(4 * 6).reshape(4, 6)
    for dim in (0, 1):
        blocks = [tensor[shard_index(tensor.shape, dim, rank, 2)] for rank in range(2)]
        assert torch.equal(torch.cat(blocks, dim=dim), tensor)
    with pytest.raises(ValueError, match="does not split into 4"):
        shard_index((6, 3), 1, 0, 4)


def test_without_a_process_group_the_model_is_untouched(tiny_reference):
    model = copy.deepcopy(tiny_reference.t2v)
    modules_before = dict(model.named_modules())
    assert apply_tensor_parallel(model, None) is model
    assert dict(model.named_modules()) == modules_before


# ------------------------------------------------------------------ sharded loading, every format


def _format_paths(tiny_models, tmp_path, kind: str) -> tuple[str, str | None]:
    if kind in ("fp8", "scaled_fp8"):
        path = tmp_path / f"{kind}.safetensors"
        write_fp8_variant(tiny_models["t2v"], path, scaled=kind == "scaled_fp8")
        return str(path), None
    if kind == "vace_module":
        return str(tiny_models["t2v"]), str(tiny_models["vace_module"])
    return str(tiny_models[kind]), None


def _sharded_stored_keys(path: str, vace_module: str | None, shard_names: set[str]) -> set[tuple[str, str]]:
    with contextlib.ExitStack() as stack:
        _, _, source = transformer_weight_source(path, vace_module, stack)
        return {(str(source.refs[name].file.path), source.refs[name].key) for name in shard_names}


@pytest.mark.parametrize("kind", ["t2v", "vace", "vace_module", "diffusers_vace", "fp8", "scaled_fp8"])
def test_a_rank_reads_and_holds_only_its_slices(tiny_models, tmp_path, monkeypatch, kind):
    path, vace_module = _format_paths(tiny_models, tmp_path, kind)
    full = load_transformer(path, vace_module=vace_module)
    reads: list[tuple[str, str, int, int]] = []
    original = checkpoint.CheckpointFile.raw

    def spying_raw(self, key, index=None):
        tensor = original(self, key, index)
        reads.append((str(self.path), key, tensor.numel(), math.prod(self.shape(key))))
        return tensor

    monkeypatch.setattr(checkpoint.CheckpointFile, "raw", spying_raw)
    shard = load_transformer_shard(path, vace_module=vace_module, tp_rank=1, tp_size=2, tp_group=None)
    monkeypatch.undo()

    dims = shard.tp_plan.shard_dims()
    sharded_keys = _sharded_stored_keys(path, vace_module, set(dims))
    sharded_reads = [(numel, whole) for file, key, numel, whole in reads if (file, key) in sharded_keys]
    assert len(sharded_reads) == len(dims)
    assert all(2 * numel == whole for numel, whole in sharded_reads), "a sharded tensor was read whole"

    full_state, shard_state = read_weights(full), read_weights(shard)
    for name, tensor in shard_state.items():
        expected = full_state[name]
        if name in dims:
            expected = expected[shard_index(expected.shape, dims[name], 1, 2)]
        assert torch.equal(tensor, expected), name
    full_bytes, shard_bytes = weight_bytes(full), weight_bytes(shard)
    assert shard_bytes["sharded"] * 2 == full_bytes["sharded"]
    assert shard_bytes["replicated"] == full_bytes["replicated"]


def test_sharded_attention_uses_the_local_head_count(tiny_models):
    shard = load_transformer_shard(tiny_models["vace"], tp_rank=0, tp_size=4, tp_group=None)
    for path in shard.tp_plan.attention_modules:
        attention = shard.get_submodule(path)
        assert attention.heads == 1 and attention.to_q.out_features == 32 and attention.norm_k.weight.shape == (32,)


def test_bench_rejects_a_degree_that_does_not_divide_the_heads_before_spawning(tiny_models):
    import argparse

    from wanmesh.parallel.bench.tp import add_arguments, resolve

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    models_root = tiny_models["t2v"].parent.parent
    with pytest.raises(ValueError, match="tp=3 does not divide the model's 4 attention heads"):
        resolve(parser.parse_args(["--tp", "1,3", "--models", str(models_root), "--device", "cpu"]))
    settings = resolve(parser.parse_args(["--tp", "1,2,4", "--models", str(models_root), "--device", "cpu"]))
    assert settings["degrees"] == [1, 2, 4] and settings["num_blocks"] == 4 and settings["video_tokens"] == 5 * 6 * 8
