"""`wanmesh bench plan --hardware`: every layout priced on a GPU cluster from datasheet figures, through the command
line, by the same cost functions ``auto`` uses; bad specs refused in one line before any model is read. Expected
numbers are derived from the specs, never copied from the output."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from wanmesh.parallel import auto_layout
from wanmesh.parallel.auto_layout import Job, Layout, ModelCost
from wanmesh.parallel.bench import hardware
from wanmesh.parallel.bench.hardware import ATTENTION_FRACTION, HARDWARE, MATMUL_FRACTION
from wanmesh.parallel.bench.releases import RELEASES
from wanmesh.parallel.cli import main

GIB = 2**30
H100 = HARDWARE["h100-sxm"]
WAN_720P = ["--model", "wan21-14b", "--width", "1280", "--height", "720", "--frames", "81", "--steps", "40"]


def plan(tmp_path, capsys, *flags: str) -> tuple[dict, str]:
    """The JSON and the printed table of one ``bench plan --hardware`` run, which must succeed."""
    out = tmp_path / "plan.json"
    assert main(["bench", "plan", "--quiet", *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def refusal(capsys, *flags: str) -> str:
    """The one stderr line of a ``bench plan`` refused with exit code 2, nothing printed on stdout."""
    assert main(["bench", "plan", "--quiet", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured
    return captured.err.strip()


@pytest.fixture
def no_model_read(monkeypatch):
    """Fail if a refusal gets as far as reading the model."""
    monkeypatch.setattr(hardware, "model_of", lambda name: pytest.fail("the model was read before the refusal"))


def test_eight_h100_speed_wan_14b_up_and_the_choice_fits(tmp_path, capsys):
    result, printed = plan(tmp_path, capsys, "--hardware", "h100-sxm", *WAN_720P)
    chosen = [row for row in result["layouts"] if row["chosen"]]
    assert len(chosen) == 1 and chosen[0]["layout"] == result["chosen"] == result["layouts"][0]["layout"]
    assert chosen[0]["fits"] and chosen[0]["memory_bytes"]["total"] <= H100.memory_gib * GIB
    by_gpus = {row["gpus"]: row for row in result["by_gpus"]}
    assert sorted(by_gpus) == [1, 2, 4, 8] and by_gpus[8]["speed_up"] > 1 and by_gpus[1]["speed_up"] == 1
    assert by_gpus[8]["predicted_s"] == chosen[0]["predicted_s"]
    flops = result["flops_per_step"]
    assert result["floor_s"] == pytest.approx(flops / (H100.bf16_tflops * 1e12 * 8))
    assert all(row["predicted_s"] >= result["floor_s"] for row in result["layouts"])  # nothing beats the peak
    assert f"* {result['chosen']}" in printed and "auto chose:" in printed
    assert "prediction from datasheet figures, not a measurement" in printed and "physical floor" in printed


def test_the_json_has_every_layout_with_its_memory_parts(tmp_path, capsys):
    result, _ = plan(tmp_path, capsys, "--hardware", "h100-sxm", *WAN_720P)
    model = ModelCost.from_config(RELEASES["wan21-14b"], result["weight_bytes"])
    job = Job(1280, 720, 81, steps=40)
    expected = {layout.name() for layout in auto_layout.candidate_layouts(8, model, job)}
    assert {row["layout"] for row in result["layouts"]} == expected and len(result["layouts"]) == len(expected)
    for row in result["layouts"]:
        parts = row["memory_bytes"]
        assert parts["weights"] == result["weight_bytes"] // row["tp"]
        assert parts["weights"] + parts["activations"] == parts["total"]


def test_the_prediction_is_the_cost_model_auto_uses(tmp_path, capsys):
    """One layout's row equals ``auto_layout.predict`` on the machine the spec makes, whose speeds are the peak at
    the documented fractions."""
    result, _ = plan(tmp_path, capsys, "--hardware", "h100-sxm", *WAN_720P)
    machine = hardware.machine(H100, 8, 8)
    assert machine.matmul_flops == H100.bf16_tflops * 1e12 * MATMUL_FRACTION
    assert machine.attention_flops == H100.bf16_tflops * 1e12 * ATTENTION_FRACTION
    model = ModelCost.from_config(RELEASES["wan21-14b"], result["weight_bytes"])
    row = next(row for row in result["layouts"] if row["tp"] == 2 and row["cfg_parallel"])
    layout = Layout(row["tp"], row["ulysses"], row["ring"], row["cfg_parallel"], row["vae_patch"])
    prediction = auto_layout.predict(layout, 8, model, Job(1280, 720, 81, steps=40), machine)
    assert (row["predicted_s"], row["memory_bytes"]["total"], row["fits"]) == (
        prediction.step_s, prediction.memory_bytes, prediction.fits)


def test_a_14b_bf16_model_does_not_fit_one_rtx_4090(tmp_path, capsys):
    result, printed = plan(tmp_path, capsys, "--hardware", "rtx-4090", "--gpus-per-node", "1", *WAN_720P)
    assert result["weight_bytes"] > HARDWARE["rtx-4090"].memory_gib * GIB
    assert [row["fits"] for row in result["layouts"]] == [False] and result["chosen"] is None
    assert "auto chose nothing: no layout of 1 ranks fits" in printed


def test_two_nodes_name_the_groups_that_cross_them(tmp_path, capsys):
    result, printed = plan(tmp_path, capsys, "--hardware", "h100-sxm", "--gpus-per-node", "2", "--nodes", "2",
                           *WAN_720P)
    assert result["world"] == 4 and all(row["cross_host"] is not None for row in result["layouts"])
    assert any(row["cross_host"] for row in result["layouts"]) and "across hosts" in printed


def test_a_hardware_file_is_read_as_the_named_spec(tmp_path, capsys):
    spec = tmp_path / "h100.toml"
    spec.write_text("".join(f"{name} = {json.dumps(value)}\n" for name, value in asdict(H100).items()))
    from_file, _ = plan(tmp_path, capsys, "--hardware-file", str(spec), *WAN_720P)
    named, _ = plan(tmp_path, capsys, "--hardware", "h100-sxm", *WAN_720P)
    assert from_file["layouts"] == named["layouts"] and from_file["hardware"] == asdict(H100)


@pytest.mark.parametrize("flags, says", [
    (["--hardware", "b300"], "--hardware: unknown GPU 'b300'; valid: h100-sxm"),
    (["--hardware", "h100-sxm", "--world", "4"], "--world counts ranks on this machine"),
    (["--hardware", "h100-sxm", "--nodes", "0"], "--nodes must be a positive integer, got 0"),
    (["--gpus-per-node", "4"], "--gpus-per-node and --nodes describe the cluster of --hardware"),
], ids=["unknown-gpu", "world", "nodes", "cluster-alone"])
def test_bad_hardware_flags_are_one_line_before_anything_runs(capsys, no_model_read, flags, says):
    assert says in refusal(capsys, *flags, *WAN_720P)


@pytest.mark.parametrize("text, says", [
    ("name = [", "not TOML"),
    ('name = "x"\n', "missing field bf16_tflops"),
    ("".join(f"{name} = {json.dumps(value)}\n" for name, value in asdict(H100).items()) + "tflops = 1\n",
     "unknown field tflops"),
    ("".join(f"{name} = {json.dumps(-1 if name == 'memory_gib' else value)}\n"
             for name, value in asdict(H100).items()), "field memory_gib must be a positive number, got -1"),
], ids=["not-toml", "missing", "unknown", "invalid"])
def test_a_bad_hardware_file_is_one_line_naming_the_field(tmp_path, capsys, no_model_read, text, says):
    spec = tmp_path / "spec.toml"
    spec.write_text(text)
    line = refusal(capsys, "--hardware-file", str(spec), *WAN_720P)
    assert says in line and ("valid fields: name, bf16_tflops" in line or says == "not TOML")
