"""`wanmesh bench real-size`: the released Wan 2.1 1.3B in bf16 (2.64 GiB, ComfyUI's single-file layout) written on
the fly and loaded at world 1, tp 2 and two replicas (Ulysses / ring / CFG hold whole copies), computing in bf16; the
released shapes of every model and file kind from the header alone. Memory is asserted in bytes of tensors (no
timed assertions): each rank's resident model within 1.1 x its share of the file + 0.5 GiB; the same file streamed
block by block under a 1 GB budget holds at most the budget on the device and moves its blocks once per step."""

from __future__ import annotations

import json
import math

import pytest

from wanmesh.parallel.bench import real_size
from wanmesh.parallel.bench.releases import RELEASES
from wanmesh.parallel.cli import main

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


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("real_size")
    code = main(["bench", "real-size", "--model", "wan21-1.3b", "--kind", "bf16", "--layouts",
                 "world1,tp2,replicas2", "--device", "cpu", "--memory-budget-gb", "1.0", "--repeats", "1", "--work", str(out), "--json", str(out / "rows.json")])
    assert code == 0
    assert not list(out.glob("*.safetensors")), "the written file is deleted after the run"
    return json.loads((out / "rows.json").read_text())


def test_every_layout_loads_the_real_file_and_steps(measured):
    rows = measured["rows"]
    assert [(row["layout"], row["rank"]) for row in rows] == [("world1", 0), ("tp2", 0), ("tp2", 1),
                                                               ("replicas2", 0), ("replicas2", 1)]
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
        assert rows["replicas2", rank]["share_bytes"] == whole
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
