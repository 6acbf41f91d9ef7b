"""`tests/gpu/run.sh --dry-run`: the GPU check's every section run on the CPU at the smallest sizes, so the script
that proves and measures the CUDA path cannot rot between the runs on a GPU. Checks the report's structure, that
every correctness check ran and passed (the CUDA-only tests are collected and skip here), that every measurement
section produced its rows and that no section was skipped for the deadline; and that without CUDA and without
--dry-run the script refuses in one line with status 2."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "gpu" / "run.sh"
CHECKS = ["cuda_tests", "world1_vs_cpu", "attention_backends", "quantized_layers", "vae_decode", "two_ranks",
          "half_precision_sampling"]
MEASUREMENTS = ["transformer_step", "quantized_step", "load_time", "vae_decode_time", "torch_compile"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(out), "--deadline", "500"],
                            capture_output=True, text=True, timeout=540, env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "gpu_report.json").read_text()), (out / "gpu_report.md").read_text()


def test_every_check_ran_and_passed(dry_run):
    report, _ = dry_run
    assert report["mode"] == "dry-run" and report["device"]["type"] == "cpu"
    assert report["skipped_for_deadline"] == []
    checks = {entry["name"]: entry for entry in report["checks"]}
    assert list(checks) == CHECKS
    cuda_tests = checks.pop("cuda_tests")  # collected by pytest, skipped without a GPU
    assert cuda_tests["status"] == "skipped" and cuda_tests["tests"] == cuda_tests["skipped"] >= 13, cuda_tests
    for name, entry in checks.items():
        assert entry["status"] == "pass", (name, entry)
        assert entry["rows"] and all(row["ok"] and row["error"] <= row["tolerance"] for row in entry["rows"]), entry
    assert {row["what"].split()[0] for row in checks["attention_backends"]["rows"]} == {"cpu_flash", "math"}
    assert {row["what"].rsplit(" ", 1)[0] for row in checks["quantized_layers"]["rows"]} == {
        "fp8 e4m3fn", "scaled fp8", "fp8 e5m2", "GGUF Q8_0", "GGUF Q4_K"}
    assert {row["what"].split()[1] for row in checks["vae_decode"]["rows"]} == {"2.1", "2.2"}
    assert checks["two_ranks"]["backend"] == "gloo"
    assert [row["what"].split(" (")[0] for row in checks["two_ranks"]["rows"]] == ["tp 2", "ulysses 2"]
    # a rank's whole sampling path in bf16 and fp16 (both loops and a native-MODEL call), nothing cast for it
    assert sorted(row["what"] for row in checks["half_precision_sampling"]["rows"]) == sorted(
        f"{what} {dtype}" for what in ("sample uni_pc", "sample wan_unipc", "model call") for dtype in ("bf16", "fp16"))
    assert all(row["finite"] and row["error"] > 1e-5 for row in checks["half_precision_sampling"]["rows"])


def test_every_measurement_has_its_rows(dry_run):
    report, markdown = dry_run
    measurements = {entry["name"]: entry for entry in report["measurements"]}
    assert list(measurements) == MEASUREMENTS
    assert all(entry["status"] == "done" for entry in measurements.values()), measurements
    step = measurements["transformer_step"]["rows"]
    assert {row["variant"] for row in step} == {"diffusers", "WanMesh world 1", "WanMesh attention seam"}
    assert all(row["median_s"] > 0 and row["tflops"] > 0 and row["predicted_bytes"] > 0 for row in step)
    assert {row["weights"] for row in measurements["quantized_step"]["rows"]} == {"bf16", "fp8 scaled", "Q4_K"}
    assert {row["loader"] for row in measurements["load_time"]["rows"]} == {"WanMesh load_transformer",
                                                                             "diffusers from_pretrained"}
    assert measurements["vae_decode_time"]["per_frame_s"] > 0
    assert {row["mode"] for row in measurements["torch_compile"]["rows"]} == {"eager", "compiled"}
    assert {target["result"] for target in report["targets"]} <= {"n/a (dry run)", "not measured"}
    for heading in ("### Checks", "### Transformer forward", "### Kept quantized weights", "### Targets"):
        assert heading in markdown


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_without_cuda_it_refuses_in_one_line(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "--dry-run" in result.stderr
    assert not (tmp_path / "gpu_report.json").exists()
