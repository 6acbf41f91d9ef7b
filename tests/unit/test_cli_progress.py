"""Progress of the commands other than generate, as a user meets it (fresh interpreters, stderr not a terminal):
`make-tiny` names each file as it writes it (n/N) and writes the same tree as before; `bench` announces each
measured run with the total expected (nothing with --quiet); `stream --timings` writes the phases and each
chunk's latency as JSON."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from cli_runs import run_cli

ENV = {"WANMESH_WORKER_THREADS": "1"}


def _digests(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    """`wanmesh make-tiny DIR`: its run and the tree it wrote."""
    root = tmp_path_factory.mktemp("cli_tiny") / "models"
    return {"root": root, **run_cli(["make-tiny", str(root)], root.parent, ENV)}


def test_make_tiny_names_each_file_as_it_writes_it(made, tiny_models_root):
    assert made["code"] == 0, made["stderr"]
    lines = re.findall(r"^  write (\d+)/(\d+): (.+)$", made["stderr"], re.MULTILINE)
    totals = {total for _, total, _ in lines}
    assert len(totals) == 1 and [int(n) for n, _, _ in lines] == list(range(1, int(totals.pop()) + 1)), made["stderr"]
    named = [what for _, _, what in lines]
    for relative in ("diffusion_models/wan_tiny_t2v.safetensors", "diffusers/wan_tiny_vace"):
        assert relative in named and (made["root"] / relative).exists(), named
    assert _digests(made["root"]) == _digests(tiny_models_root)  # the same files as make_tiny without a callback


def test_bench_announces_each_measured_run_and_quiet_none(tmp_path):
    command = ["bench", "pool", "--world", "1", "--frames", "2", "--height", "16", "--width", "16", "--repeats", "2",
               "--empty-repeats", "3", "--chunk-repeats", "2", "--chunk-frames", "1"]
    shown = run_cli([*command, "--start-repeats", "1"], tmp_path, ENV)  # the pool starts are a fourth run
    quiet = run_cli([*command, "--start-repeats", "0", "--quiet"], tmp_path, ENV)
    assert shown["code"] == quiet["code"] == 0, shown["stderr"] + quiet["stderr"]
    runs = re.findall(r"^bench pool: run (\d+)/(\d+) \((.+?)\)", shown["stderr"], re.MULTILINE)
    assert [(int(n), int(total)) for n, total, _ in runs] == [(1, 4), (2, 4), (3, 4), (4, 4)], shown["stderr"]
    assert "2 pool starts per way of starting" in runs[3][2]
    assert "3 empty requests" in runs[0][2] and "s left" in shown["stderr"]
    assert "bench pool: run" not in quiet["stderr"] and "empty request round trip" in quiet["stdout"]


def test_time_interleaved_announces_warm_ups_and_rounds(monkeypatch, capsys):
    import torch

    from wanmesh.parallel.bench.common import PROGRESS_ENV, time_interleaved

    calls = {"a": lambda: None, "b": lambda: None}
    time_interleaved(calls, torch.device("cpu"), 2)
    assert capsys.readouterr().err == ""  # outside `wanmesh bench`: silent
    monkeypatch.setenv(PROGRESS_ENV, "x")
    time_interleaved(calls, torch.device("cpu"), 2)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"bench x: run {n}/6" for n in range(1, 7)]
    assert "(a, warm-up)" in lines[0] and "(b, round 2/2)" in lines[5]


def test_stream_timings_has_phases_and_each_chunk(made, tmp_path):
    timings, chunk_dir = tmp_path / "timings.json", tmp_path / "chunks"
    result = run_cli(["stream", "--models", str(made["root"]), "--prompt", "a fox", "--width", "32", "--height", "32",
                      "--frames", "9", "--chunk", "1", "--steps", "1", "--device", "cpu",
                      "--out", str(tmp_path / "v.mp4"), "--chunk-dir", str(chunk_dir), "--timings", str(timings)], tmp_path, ENV)
    assert result["code"] == 0, result["stderr"]
    written = json.loads(timings.read_text())
    assert {"pool_start", "text_encode", "weight_load", "streaming", "write"} <= set(written["phases_s"])
    chunks = written["chunks"]
    assert [chunk["index"] for chunk in chunks] == [0, 1, 2]  # 9 frames: 3 latent frames, chunks of 1
    assert [chunk["latent_frames"] for chunk in chunks] == [[0, 0], [1, 1], [2, 2]]
    assert sum(chunk["frames"] for chunk in chunks) == 9
    since = [chunk["since_start_s"] for chunk in chunks]
    assert since == sorted(since) and since[-1] <= written["phases_s"]["streaming"]
    assert sum(chunk["latency_s"] for chunk in chunks) == pytest.approx(since[-1])
    assert "timings: 3 chunks" in result["stderr"]
