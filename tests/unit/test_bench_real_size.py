"""`wanmesh bench real-size`: the released Wan 2.1 1.3B in bf16 (2.64 GiB, ComfyUI's single-file layout) written on
the fly and loaded at world 1 and tp 2 (Ulysses, ring and CFG ranks hold whole copies, loaded as at world 1: the
``replicas2`` layout of the command, left out here for CI time), computing in bf16; the
same model as a Q8_0 GGUF (ComfyUI-GGUF's layout, 1.41 GiB) at world 1; the released shapes of every model and file
kind from the header alone; a small GGUF written tensor by tensor reads back as drawn. Memory is asserted in bytes of
tensors (no timed assertions): each rank's resident model within 1.1 x its share of the file + 0.5 GiB, the bf16
file's weights staying bf16 and the GGUF's staying in their quant blocks (about the file's size, half the bf16
model's); the same file streamed block by block under a 1 GB budget holds at most the budget on the device and moves
its blocks once per step."""

from __future__ import annotations

import json
import math

import gguf
import pytest
import torch

from wanmesh.parallel.bench import real_size
from wanmesh.parallel.bench.releases import RELEASES
from wanmesh.parallel.cli import main
from wanmesh.parallel.tiny.models import TINY_TRANSFORMER
from wanmesh.parallel.weights.gguf_file import GGUFFile

GIB = 2**30
RELEASED_GIB = {  # the released files' sizes (bf16, ComfyUI's scaled fp8), GiB
    ("wan21-1.3b", "bf16"): 2.64, ("wan21-14b", "bf16"): 26.61, ("wan21-14b", "fp8_scaled"): 13.53,
    ("wan22-ti2v-5b", "bf16"): 9.31, ("wan21-vace-14b", "fp8_scaled"): 16.37,
}


@pytest.mark.parametrize("model, kind", RELEASED_GIB)
def test_the_released_layouts_have_the_released_sizes(model, kind):
    entries = real_size.release_layout(RELEASES[model], kind)
    size = sum(dtype.itemsize * math.prod(shape) for _, dtype, shape in entries) / GIB
    assert size == pytest.approx(RELEASED_GIB[model, kind], abs=0.01)
    keys = [key for key, _, _ in entries]
    assert "blocks.0.self_attn.q.weight" in keys and "head.head.weight" in keys  # ComfyUI's single-file names
    if kind == "fp8_scaled":
        assert "scaled_fp8" in keys and "blocks.0.ffn.0.scale_weight" in keys


@pytest.mark.parametrize("kind, block_bytes", [("gguf_q8_0", 34 / 32), ("gguf_q4_k", 144 / 256)])
def test_the_gguf_layouts_quantize_the_matrices_and_keep_the_rest_float(kind, block_bytes):
    config = RELEASES["wan21-1.3b"]
    layout = real_size.gguf_layout(config, kind)
    stored = {key: tensor_type.name for key, tensor_type, _ in layout}
    quantized = "Q8_0" if kind == "gguf_q8_0" else "Q4_K"
    assert stored["blocks.0.ffn.2.weight"] == stored["text_embedding.0.weight"] == quantized
    assert stored["blocks.0.modulation"] == stored["patch_embedding.weight"] == stored["blocks.0.norm3.weight"] == "F32"
    values = {name: sum(math.prod(shape) for key, _, shape in layout if stored[key] == name)
              for name in ("F32", quantized)}
    assert set(stored.values()) == set(values) and values["F32"] < 1e-3 * values[quantized]
    assert real_size.layout_bytes(config, kind) == 4 * values["F32"] + block_bytes * values[quantized]


def test_a_written_gguf_reads_back_as_drawn(tmp_path):
    path = real_size.write_release_file(TINY_TRANSFORMER, "gguf_q8_0", tmp_path / "tiny.gguf")
    layout = real_size.gguf_layout(TINY_TRANSFORMER, "gguf_q8_0")
    reader = GGUFFile(path)
    assert reader.keys == [key for key, _, _ in layout]
    assert {reader.tensor_type(key) for key in reader.keys} == {gguf.GGMLQuantizationType.Q8_0,
                                                               gguf.GGMLQuantizationType.F32}
    for key, tensor_type, shape in layout:
        assert reader.tensor_type(key) == tensor_type and reader.shape(key) == shape
        drawn = real_size._drawn(key, shape)
        exact = tensor_type == gguf.GGMLQuantizationType.F32
        # Q8_0: int8 steps of a block's largest magnitude / 127 (the step an f16): half a step off, and the
        # step's own rounding times up to 127 steps (2^-11 x 127 = 0.06 steps)
        tolerance = 0 if exact else drawn.abs().max().item() / 127 * 0.6
        torch.testing.assert_close(reader.read_dequantised(key, torch.float32), drawn, rtol=0, atol=tolerance)
    assert path.stat().st_size - real_size.layout_bytes(TINY_TRANSFORMER, "gguf_q8_0") < 2**20  # the header


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("real_size")
    code = main(["bench", "real-size", "--model", "wan21-1.3b", "--kind", "bf16", "--layouts",
                 "world1,tp2", "--device", "cpu", "--memory-budget-gb", "1.0", "--repeats", "1",
                 "--work", str(out), "--json", str(out / "rows.json")])
    assert code == 0
    assert not list(out.glob("*.safetensors")), "the written file is deleted after the run"
    return json.loads((out / "rows.json").read_text())


def test_every_layout_loads_the_real_file_and_steps(measured):
    rows = measured["rows"]
    assert [(row["layout"], row["rank"]) for row in rows] == [("world1", 0), ("tp2", 0), ("tp2", 1)]
    for row in rows:
        assert row["file_bytes"] / GIB == pytest.approx(2.64, abs=0.01)
        assert row["step_s"] > 0 and row["load_s"] > 0


def test_each_rank_holds_its_share_of_the_file(measured):
    rows = {(row["layout"], row["rank"]): row for row in measured["rows"]}
    whole = rows["world1", 0]["share_bytes"]
    assert 0.99 * rows["world1", 0]["file_bytes"] < whole <= rows["world1", 0]["file_bytes"]  # less the header
    for rank in (0, 1):
        # tp 2 halves every sharded tensor; the replicated embeddings, norms and modulation tables stay whole
        assert 0.5 * whole < rows["tp2", rank]["share_bytes"] < 0.52 * whole
    for row in rows.values():
        assert row["resident_target"], row
        assert row["resident_bytes"] <= 1.01 * row["share_bytes"], "bf16 weights stay bf16 on the rank"


def test_streamed_blocks_stay_within_the_budget_and_move_once_per_step(measured):
    for row in measured["rows"]:
        assert row["streamed_device_bytes"] <= 1e9, row
        # every block once per forward: the share less what stays on the device (embeddings, head, modulation)
        blocks = row["streamed_bytes_per_step"]
        assert 0.95 * row["share_bytes"] < blocks < row["share_bytes"], row
        assert row["streamed_step_ratio"] > 0


@pytest.fixture(scope="module")
def measured_gguf(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("real_size_gguf")
    code = main(["bench", "real-size", "--model", "wan21-1.3b", "--kind", "gguf_q8_0", "--layouts", "world1",
                 "--device", "cpu", "--memory-budget-gb", "1.0", "--repeats", "1", "--work", str(out),
                 "--json", str(out / "rows.json")])
    assert code == 0
    assert not list(out.glob("*.gguf")), "the written file is deleted after the run"
    return json.loads((out / "rows.json").read_text())


def test_a_gguf_stays_in_its_quant_blocks_on_the_rank(measured_gguf):
    [row] = measured_gguf["rows"]
    assert (row["kind"], row["layout"]) == ("gguf_q8_0", "world1") and row["step_s"] > 0 and row["load_s"] > 0
    assert row["file_bytes"] / GIB == pytest.approx(1.41, abs=0.01)
    assert 0.99 * row["file_bytes"] < row["share_bytes"] <= row["file_bytes"]
    # kept quantized, the model is the file's blocks and its few float tensors; dequantized it would be the bf16
    # model's 2.64 GiB
    assert row["resident_target"], row
    assert 0.97 * row["share_bytes"] < row["resident_bytes"] <= 1.01 * row["share_bytes"]
    assert row["largest_tensor_bytes"] == 6 * 1536 * 1536 // 32 * 34  # time_projection.1, in Q8_0 blocks


def test_a_streamed_gguf_moves_its_quant_blocks_once_per_step(measured_gguf):
    [row] = measured_gguf["rows"]
    assert row["streamed_device_bytes"] <= 1e9, row
    assert 0.95 * row["share_bytes"] < row["streamed_bytes_per_step"] < row["share_bytes"], row
