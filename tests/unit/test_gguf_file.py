"""GGUF transformer files: every dequantised weight equals the gguf package's own dequantisation of the whole
stored tensor (read here straight from ``gguf.GGUFReader``), on one rank and as tp=2 shards (sharded loading
without a process group: the shards concatenated along the plan's split dimension give the whole tensor), for
Q8_0 and Q4_K, with both column (output rows) and row (input blocks) splits quantised."""

from __future__ import annotations

import contextlib

import gguf
import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

from wanmesh.parallel.weights.gguf_file import GGUFFile
from wanmesh.parallel.tiny.gguf_write import write_wan_gguf
from wanmesh.parallel.weights.sharded import load_transformer_shard
from wanmesh.parallel.tiny.models import original_state_dict, original_transformer_names, randomise_
from wanmesh.parallel.weights.loaders import load_transformer, transformer_weight_source
from wanmesh.parallel.weights.quantized import read_weights

Q = gguf.GGMLQuantizationType
# Input dims of 256 / 512 so K-quant blocks (256) also fit the halves a row-parallel tp=2 split reads.
WIDE_CONFIG = dict(
    patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=256, freq_dim=256, ffn_dim=512, num_layers=1, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6,
)


@pytest.fixture(scope="module")
def wide_files(tmp_path_factory) -> dict[str, str]:
    model = WanTransformer3DModel(**WIDE_CONFIG)
    randomise_(model, seed=5)
    state = original_state_dict(model, original_transformer_names(WIDE_CONFIG), convert_wan_transformer_to_diffusers)
    folder = tmp_path_factory.mktemp("wide_gguf")
    files = {}
    for tensor_type in (Q.Q8_0, Q.Q4_K):
        files[tensor_type.name] = str(folder / f"wan_wide_{tensor_type.name}.gguf")
        write_wan_gguf(state, files[tensor_type.name], tensor_type, num_heads=WIDE_CONFIG["num_attention_heads"])
    return files


def gguf_reference(path: str) -> dict[str, tuple[Q, torch.Tensor]]:
    """{stored key: (type, whole tensor)} dequantised by the gguf package alone, dims reversed to torch order."""
    reader = gguf.GGUFReader(path)
    return {tensor.name: (tensor.tensor_type, torch.from_numpy(np.array(
        gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type), dtype=np.float32)).reshape(
        tuple(int(d) for d in reversed(tensor.shape))))
        for tensor in reader.tensors}


def stored_keys(path: str) -> dict[str, str]:
    """{model parameter name: stored GGUF key}, from the loader's own name map."""
    with contextlib.ExitStack() as stack:
        _, _, source = transformer_weight_source(path, None, stack)
        return {name: ref.key for name, ref in source.refs.items()}


def _check_full_model(path: str, tensor_type: Q) -> None:
    reference, keys = gguf_reference(path), stored_keys(path)
    model = load_transformer(path)
    assert sum(reference[key][0] == tensor_type for key in keys.values()) >= 5, f"too few {tensor_type.name} tensors"
    for name, tensor in read_weights(model).items():
        assert torch.equal(tensor, reference[keys[name]][1]), f"{name}: loaded != gguf dequantisation"


@pytest.mark.parametrize("tensor_type", [Q.Q8_0, Q.Q4_K])
def test_one_rank_equals_gguf_dequantisation(wide_files, tensor_type):
    _check_full_model(wide_files[tensor_type.name], tensor_type)


@pytest.mark.parametrize("tensor_type", [Q.Q8_0, Q.Q4_K])
def test_tp2_shards_concatenate_to_gguf_dequantisation(wide_files, tensor_type):
    path = wide_files[tensor_type.name]
    reference, keys = gguf_reference(path), stored_keys(path)
    shards = [load_transformer_shard(path, tp_rank=rank, tp_size=2, tp_group=None) for rank in (0, 1)]
    plan = shards[0].tp_plan.shard_dims()
    split_quantised = {dim: [name for name, d in plan.items() if d == dim and reference[keys[name]][0] == tensor_type]
                       for dim in (0, 1)}
    assert split_quantised[0] and split_quantised[1], f"need quantised column and row splits: {split_quantised}"
    states = [read_weights(shard) for shard in shards]
    for name, whole in ((name, reference[keys[name]][1]) for name in keys):
        if name in plan:
            joined = torch.cat([states[0][name], states[1][name]], dim=plan[name])
            assert torch.equal(joined, whole), f"{name}: tp=2 shards != gguf dequantisation"
        else:
            assert torch.equal(states[0][name], whole) and torch.equal(states[1][name], whole), name


def test_sliced_reads_touch_only_their_blocks(wide_files):
    """An input-dim slice on block boundaries dequantises just its blocks; the same slice of the whole agrees; a
    slice that cuts blocks is decoded from whole rows and agrees too."""
    path = wide_files["Q4_K"]
    checkpoint = GGUFFile(path)
    whole = gguf_reference(path)["blocks.0.ffn.2.weight"][1]
    assert checkpoint.shape("blocks.0.ffn.2.weight") == (512, 512)
    right = checkpoint.read_dequantised("blocks.0.ffn.2.weight", torch.float32, (slice(None), slice(256, 512)))
    rows = checkpoint.read_dequantised("blocks.0.ffn.2.weight", torch.float32, (slice(100, 140),))
    assert torch.equal(right, whole[:, 256:]) and torch.equal(rows, whole[100:140])
    assert checkpoint.read_stored("blocks.0.ffn.2.weight", (slice(None), slice(0, 128))) is None  # cuts Q4_K blocks
    cut = checkpoint.read_dequantised("blocks.0.ffn.2.weight", torch.float32, (slice(None), slice(0, 128)))
    assert torch.equal(cut, whole[:, :128])


@pytest.mark.parametrize("name, tensor_type, tolerance", [("t2v_gguf_q8_0", Q.Q8_0, 0.01), ("t2v_gguf_q4_k", Q.Q4_K, 0.1)])
def test_tiny_files_match_gguf_and_the_float_model(tiny_models, tiny_reference, name, tensor_type, tolerance):
    """`make-tiny`'s GGUF files: original Wan keys, arch "wan", the head count, and weights near the float model."""
    path = str(tiny_models[name])
    checkpoint = GGUFFile(path)
    assert checkpoint.architecture == "wan" and checkpoint.metadata == {"num_heads": "4"}
    assert "blocks.0.self_attn.q.weight" in checkpoint.keys and checkpoint.shape("patch_embedding.weight") == (128, 16, 1, 2, 2)
    assert all(checkpoint.tensor_type(key) == Q.F32 for key in checkpoint.keys if len(checkpoint.shape(key)) == 1)
    _check_full_model(path, tensor_type)
    loaded, floats = read_weights(load_transformer(path)), tiny_reference.t2v.state_dict()
    for key, tensor in floats.items():
        assert (loaded[key] - tensor).abs().max() <= tolerance * tensor.abs().max(), key


def test_vace_module_merges_onto_a_gguf_base(tiny_models):
    """A VACE module (safetensors) on a GGUF T2V base: the base weights are the GGUF ones, the VACE ones the module's."""
    base_path = str(tiny_models["t2v_gguf_q8_0"])
    merged = read_weights(load_transformer(base_path, vace_module=str(tiny_models["vace_module"])))
    base, full_vace = read_weights(load_transformer(base_path)), load_transformer(str(tiny_models["vace"])).state_dict()
    assert set(merged) == set(full_vace)
    for name, tensor in merged.items():
        expected = base[name] if name in base else full_vace[name]
        assert torch.equal(tensor, expected), name
