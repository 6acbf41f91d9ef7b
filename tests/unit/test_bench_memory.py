"""`wanmesh bench memory` on the tiny GGUF and scaled fp8 files: every key per rank, positive and consistent
numbers, the file's slices read from headers alone, and the argument checks (no timed assertions)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from wanmesh.parallel.bench import memory
from wanmesh.parallel.cli import main
from wanmesh.parallel.tiny.files import TINY_FILES
from wanmesh.parallel.worker.memory import resident_bytes

SMALL = ["--width", "32", "--height", "32", "--frames", "5", "--steps", "2"]


def _bench(tiny_models, tmp_path, name: str, *flags: str) -> dict:
    out = tmp_path / f"{name}.json"
    root = tiny_models["t2v"].parent.parent
    assert main(["bench", "memory", "--models", str(root), "--device", "cpu", "--json", str(out), *SMALL, *flags]) == 0
    return json.loads(out.read_text())


def _check_ranks(result: dict, world: int) -> None:
    assert [row["rank"] for row in result["ranks"]] == list(range(world))
    for row in result["ranks"]:
        assert set(memory.RANK_KEYS) <= set(row)
        assert all(row[key] > 0 for key in memory.RANK_KEYS if key != "rank")
        for mode in ("keep", "dequantize"):
            low, high = row[f"step_s_{mode}_spread"]
            assert 0 < low <= row[f"step_s_{mode}"] <= high


def test_one_rank_on_the_tiny_gguf(tiny_models, tmp_path, capsys):
    result = _bench(tiny_models, tmp_path, "gguf")  # the default model: the tiny Q8_0 GGUF
    assert (result["world"], result["tp"], result["kind"], result["dtype"]) == (1, 1, "Q8_0", "bf16")
    assert result["model"].endswith(TINY_FILES["model_gguf"]) and result["latent"] == [1, 16, 2, 4, 4]
    _check_ranks(result, 1)
    (row,) = result["ranks"]
    assert row["file_slice_bytes"] == memory.file_slice_bytes(result["model"], 1)
    assert row["file_slice_bytes"] < tiny_models["t2v_gguf_q8_0"].stat().st_size
    *table, done = capsys.readouterr().out.splitlines()  # the table, then the command's result line
    assert "Q8_0" in table[0] and "keep s/step" in table[1] and len(table) == 5 and done.startswith("bench memory done")


def test_two_tensor_parallel_ranks_on_the_tiny_scaled_fp8(tiny_models, tmp_path):
    result = _bench(tiny_models, tmp_path, "fp8", "--model", str(tiny_models["t2v_fp8_scaled"]), "--world", "2")
    assert (result["world"], result["tp"], result["kind"]) == (2, 2, "F8_E4M3 scaled")
    _check_ranks(result, 2)
    whole = memory.file_slice_bytes(str(tiny_models["t2v_fp8_scaled"]), 1)
    for row in result["ranks"]:
        assert row["file_slice_bytes"] == memory.file_slice_bytes(str(tiny_models["t2v_fp8_scaled"]), 2)
        assert 0.5 * whole < row["file_slice_bytes"] < 0.75 * whole  # the block linears halve, the rest stays


@pytest.mark.parametrize("key", ["t2v_gguf_q8_0", "t2v_gguf_q4_k", "t2v_fp8_scaled", "t2v"])
def test_file_slices_halve_the_sharded_part_at_tp_2(tiny_models, key):
    path = str(tiny_models[key])
    stored = memory.stored_tensors(path)
    sharded = sum(size for name, (_, size) in stored.items() if "blocks." in name and ("attn" in name or "ffn" in name))
    whole, half = memory.file_slice_bytes(path, 1), memory.file_slice_bytes(path, 2)
    assert whole == sum(size for name, (_, size) in stored.items() if name != "scaled_fp8")
    assert whole - half == pytest.approx(sharded / 2, rel=0.02)  # the q/k norms split too, biases of o/ffn.2 not


def test_storages_count_once():
    linear = torch.nn.Linear(4, 4)
    linear.register_buffer("view", linear.weight.detach()[:2])  # a view shares the weight's storage
    assert resident_bytes(linear) == (16 + 4) * 4


def test_bad_settings_are_refused_before_spawning(tiny_models):
    parser = argparse.ArgumentParser()
    memory.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_models["t2v_gguf_q8_0"]), "--device", "cpu", "--world", "3",
                              "--tp", "2"])
    with pytest.raises(ValueError, match="--tp must divide --world"):
        memory.resolve(args)
    args.world, args.tp = 3, 3
    with pytest.raises(ValueError, match="tp=3 does not divide the model.s 4 attention heads"):
        memory.resolve(args)
