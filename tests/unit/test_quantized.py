"""Quantized weights stay as stored (``weights="keep"``): fp8, scaled fp8 and GGUF block linears, and bf16 / fp16
ones computed in float32 (the CPU's dtype), keep the file's bytes on the rank, give exactly the outputs of the same file dequantized at load, shard for tensor parallelism
(a GGUF slice that would cut quant blocks is dequantized at load, logged), and take LoRAs without any stored
weight being written."""

from __future__ import annotations

import logging

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from wanmesh.parallel.weights.checkpoint import read_safetensors_header
from wanmesh.parallel.weights.quantized import keeps_quantized, quantized_layers, read_weights
from wanmesh.parallel.weights.sharded import load_transformer_shard
from wanmesh.parallel.weights.loaders import load_transformer
from wanmesh.parallel.tiny.fp8_write import write_fp8_file
from wanmesh.parallel.tiny.models import TINY_TRANSFORMER
from wanmesh.parallel.worker.lora_merge import apply_loras
from wanmesh.parallel.worker.memory import resident_bytes

KINDS = ("fp8_e4m3fn", "fp8_e5m2", "fp8_scaled", "t2v_gguf_q8_0", "t2v_gguf_q4_k", "bf16", "fp16")
STORED_DTYPES = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp8_scaled": torch.float8_e4m3fn,
                 "t2v_gguf_q8_0": torch.uint8, "t2v_gguf_q4_k": torch.uint8, "bf16": torch.bfloat16,
                 "fp16": torch.float16}
NARROW = {"BF16": torch.bfloat16, "F16": torch.float16}  # float files narrower than the CPU's float32 compute


@pytest.fixture(scope="module")
def files(tiny_models, tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("quantized")
    state = load_file(str(tiny_models["t2v"]))
    written = {key: str(tiny_models[key]) for key in ("t2v_gguf_q8_0", "t2v_gguf_q4_k")}
    for name, dtype, scaled in (("fp8_e4m3fn", torch.float8_e4m3fn, False), ("fp8_e5m2", torch.float8_e5m2, False),
                                ("fp8_scaled", torch.float8_e4m3fn, True)):
        written[name] = str(folder / f"{name}.safetensors")
        write_fp8_file(state, written[name], dtype, scaled=scaled,
                       metadata={"num_heads": str(TINY_TRANSFORMER["num_attention_heads"])})
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        written[name] = str(folder / f"{name}.safetensors")
        save_file({key: tensor.to(dtype) for key, tensor in state.items()}, written[name],
                  metadata={"num_heads": str(TINY_TRANSFORMER["num_attention_heads"])})
    return written


def _quantized_in_file(path: str) -> int:
    """How many block linears the file stores quantized (fp8 values, or GGUF quant blocks); quantized tensors
    outside the blocks (embeddings, the head) are small and load as floats."""
    if path.endswith(".gguf"):
        floats = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
        return sum(t.tensor_type not in floats and keeps_quantized(t.name) for t in gguf.GGUFReader(path).tensors)
    header = read_safetensors_header(path)
    return sum((entry["dtype"].startswith("F8") or (entry["dtype"] in NARROW and len(entry["shape"]) == 2))
               and keeps_quantized(key) for key, entry in header.items() if key != "__metadata__")


def _forward(model: torch.nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    latents = torch.randn(1, 16, 2, 8, 8, generator=generator)
    context = torch.randn(1, 7, TINY_TRANSFORMER["text_dim"], generator=generator)
    with torch.no_grad():
        return model(latents, torch.tensor([700.0]), context, return_dict=False)[0]


@pytest.mark.parametrize("kind", KINDS)
def test_keep_holds_the_stored_bytes_and_equals_dequantize(files, kind):
    kept, expanded = (load_transformer(files[kind], weights=mode) for mode in ("keep", "dequantize"))
    layers = quantized_layers(kept)
    stored = [layer.parametrizations.weight.original for layer in layers.values()]
    assert len(layers) == _quantized_in_file(files[kind]) >= 4
    assert all(tensor.dtype == STORED_DTYPES[kind] for tensor in stored), kind
    assert not quantized_layers(expanded)
    assert resident_bytes(kept) < resident_bytes(expanded)
    weights, expected = read_weights(kept), expanded.state_dict()
    assert set(weights) == set(expected)
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
    output = _forward(kept)
    assert output.std() > 0.1 and torch.equal(output, _forward(expanded))


@pytest.mark.parametrize("kind", ["fp8_scaled", "t2v_gguf_q8_0", "bf16"])
def test_tp2_shards_keep_their_slices_of_the_stored_data(files, kind):
    whole = read_weights(load_transformer(files[kind], weights="dequantize"))
    shards = [load_transformer_shard(files[kind], tp_rank=rank, tp_size=2, tp_group=None) for rank in (0, 1)]
    plan = shards[0].tp_plan.shard_dims()
    assert quantized_layers(shards[0]).keys() == quantized_layers(shards[1]).keys() != set()
    states = [read_weights(shard) for shard in shards]
    for name, tensor in whole.items():
        joined = torch.cat([states[0][name], states[1][name]], dim=plan[name]) if name in plan else states[1][name]
        assert torch.equal(joined, tensor), name


def test_a_gguf_slice_that_cuts_quant_blocks_is_dequantized_at_load_and_logged(files, caplog):
    """The tiny Q4_K file quantizes only ffn.2 (input 256; the other matrices have 128 inputs, not a whole 256-value
    block, and are stored F16) in 256-element blocks: tp 2 would cut them in half, so each rank dequantizes them."""
    path = files["t2v_gguf_q4_k"]
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blocks.0.ffn.2.weight"] == gguf.GGMLQuantizationType.Q4_K
    assert quantized_layers(load_transformer(path))  # one rank keeps them
    with caplog.at_level(logging.WARNING, logger="wanmesh.weights"):
        shard = load_transformer_shard(path, tp_rank=1, tp_size=2, tp_group=None)
    cut = [record.getMessage() for record in caplog.records if "dequantized at load" in record.getMessage()]
    assert len(cut) == 1 and f"{_quantized_in_file(path)} tensors (" in cut[0] and "MiB" in cut[0], cut
    assert not quantized_layers(shard) and shard.blocks[0].ffn.net[2].weight.dtype == torch.float32
    whole = read_weights(load_transformer(path, weights="dequantize"))["blocks.0.ffn.net.2.weight"]
    assert torch.equal(shard.blocks[0].ffn.net[2].weight, whole[:, 128:])


@pytest.mark.parametrize("kind", ["fp8_scaled", "t2v_gguf_q4_k", "fp16"])
def test_loras_on_kept_weights_equal_loras_merged_into_dequantized_ones(files, tiny_models, kind):
    loras = [(str(tiny_models["lora_comfy"]), 0.8), (str(tiny_models["lora_kohya"]), -0.5),
             (str(tiny_models["lora_diff"]), 1.0)]
    kept, expanded = (load_transformer(files[kind], weights=mode) for mode in ("keep", "dequantize"))
    before = _forward(kept)
    stored = {path: layer.parametrizations.weight.original.clone() for path, layer in quantized_layers(kept).items()}
    for model in (kept, expanded):
        apply_loras(model, loras, path=files[kind])
    with_loras = _forward(kept)
    assert (with_loras - before).abs().max() > 1e-3
    assert torch.equal(with_loras, _forward(expanded))
    apply_loras(kept, loras[:1], path=files[kind])
    apply_loras(expanded, loras[:1], path=files[kind])
    assert torch.equal(_forward(kept), _forward(expanded))
    apply_loras(kept, [], path=files[kind])
    assert torch.equal(_forward(kept), before), "removing every LoRA must give the model that never had one"
    for path, layer in quantized_layers(kept).items():
        assert len(layer.parametrizations.weight) == 1 and torch.equal(layer.parametrizations.weight.original,
                                                                       stored[path]), path


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_table_decode_is_bit_identical_to_torch_cast_for_every_byte(fp8_dtype, dtype) -> None:
    from wanmesh.parallel.weights.quantized import fp8_values

    every_byte = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).reshape(16, 16)
    for data in (every_byte, every_byte.t()):  # a transposed (non-contiguous) slice too
        decoded, cast = fp8_values(data, dtype), data.to(dtype)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert decoded.dtype == dtype and torch.equal(decoded.view(bits), cast.view(bits))


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_a_half_precision_file_computed_in_its_own_dtype_is_not_wrapped(files, kind):
    """Only a wider compute dtype keeps the narrow weights aside: computed in the file's own dtype (the GPU's bf16)
    the weights are ordinary parameters of that dtype."""
    model = load_transformer(files[kind], dtype=STORED_DTYPES[kind], weights="keep")
    assert not quantized_layers(model) and model.blocks[0].ffn.net[2].weight.dtype == STORED_DTYPES[kind]
