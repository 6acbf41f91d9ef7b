"""The umT5 tensor-parallel plan and sharded loading of the text encoder, without processes.

A rank's shard (rank 1 of 2) is loaded in-process for every accepted format and compared with slices of
the single-device encoder; a spy on the checkpoint reader proves no sharded tensor is ever read whole.
"""

from __future__ import annotations

import math

import pytest
import torch

from checks import write_fp8_variant
from wanmesh.parallel.weights import checkpoint
from wanmesh.parallel.weights.sharded import weight_bytes
from wanmesh.parallel.distributed.tensor_parallel import shard_index
from wanmesh.parallel.weights.umt5_files import load_text_encoder
from wanmesh.parallel.weights.umt5_files import load_text_encoder_shard
from wanmesh.parallel.networks.umt5_tp import text_encoder_tp_plan



def _expected_styles(num_layers: int) -> dict[str, str]:
    styles = {}
    for index in range(num_layers):
        attention = f"encoder.block.{index}.layer.0.SelfAttention"
        feed_forward = f"encoder.block.{index}.layer.1.DenseReluDense"
        styles.update({f"{attention}.{name}": "column" for name in ("q", "k", "v")})
        styles.update({f"{attention}.o": "row", f"{attention}.relative_attention_bias": "head_table"})
        styles.update({f"{feed_forward}.wi_0": "column", f"{feed_forward}.wi_1": "column",
                       f"{feed_forward}.wo": "row"})
    return styles


def test_plan_shards_attention_heads_bias_table_and_feed_forward(tiny_reference):
    plan = text_encoder_tp_plan(tiny_reference.text_encoder)
    assert plan.styles == _expected_styles(2)
    assert plan.attention_modules == ("encoder.block.0.layer.0.SelfAttention", "encoder.block.1.layer.0.SelfAttention")
    dims = plan.shard_dims()
    assert dims["encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"] == 1
    assert not any("shared" in name or "layer_norm" in name for name in dims)


def _format_path(tiny_models, tmp_path, kind: str) -> str:
    if kind in ("fp8", "scaled_fp8"):
        path = tmp_path / f"umt5_{kind}.safetensors"
        write_fp8_variant(tiny_models["text_encoder"], path, scaled=kind == "scaled_fp8")
        return str(path)
    return str(tiny_models["text_encoder" if kind == "file" else "diffusers_t2v"])


@pytest.mark.parametrize("kind", ["file", "folder", "fp8", "scaled_fp8"])
def test_a_rank_reads_and_holds_only_its_slices(tiny_models, tmp_path, monkeypatch, kind):
    path = _format_path(tiny_models, tmp_path, kind)
    full = load_text_encoder(path).model
    reads: list[tuple[str, int, int]] = []
    original = checkpoint.CheckpointFile.raw

    def spying_raw(self, key, index=None):
        tensor = original(self, key, index)
        reads.append((key, tensor.numel(), math.prod(self.shape(key))))
        return tensor

    monkeypatch.setattr(checkpoint.CheckpointFile, "raw", spying_raw)
    shard = load_text_encoder_shard(path, tp_rank=1, tp_size=2, tp_group=None).model
    monkeypatch.undo()

    plan = text_encoder_tp_plan(full)
    full_state, shard_state = full.state_dict(), shard.state_dict()
    dims = {name: dim for name, dim in plan.shard_dims().items() if name in full_state}  # umT5 has no biases
    sharded_reads = [(numel, whole) for key, numel, whole in reads if key in dims]  # stored keys = model names
    assert len(sharded_reads) == len(dims)
    assert all(2 * numel == whole for numel, whole in sharded_reads), "a sharded tensor was read whole"
    assert full_state.keys() == shard_state.keys()
    for name, tensor in shard_state.items():
        expected = full_state[name]
        if name in dims:
            expected = expected[shard_index(expected.shape, dims[name], 1, 2)]
        assert torch.equal(tensor, expected), name
    full_bytes, shard_bytes = weight_bytes(full, plan), weight_bytes(shard, plan)
    assert shard_bytes["sharded"] * 2 == full_bytes["sharded"]
    assert shard_bytes["replicated"] == full_bytes["replicated"]
    attention = shard.encoder.block[0].layer[0].SelfAttention
    assert (attention.n_heads, attention.inner_dim, attention.key_value_proj_dim) == (2, 32, 16)


def test_a_degree_that_does_not_divide_the_heads_fails_before_reading_weights(tiny_models, monkeypatch):
    def no_reads(self, key, index=None):
        raise AssertionError(f"read {key} before checking the degree")

    monkeypatch.setattr(checkpoint.CheckpointFile, "raw", no_reads)
    monkeypatch.setattr(checkpoint, "read_tensor", no_reads)
    with pytest.raises(ValueError, match=r"tp=3 does not divide the model's 4 attention heads.*one of 1, 2, 4"):
        load_text_encoder_shard(tiny_models["diffusers_t2v"], tp_rank=0, tp_size=3, tp_group=None)
