"""Bad input through `wanmesh generate` as a user runs it (a subprocess): each case exits 2 with one line naming
the value and what is valid, and - the checks being static - before any worker process starts. Runtime faults
exit 1 with one line (a full disk leaves no file under the final name, the latents saved before it stay);
Ctrl-C exits 130 with "interrupted"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from cli_runs import LAUNCHER, RUN_TIMEOUT_S, run_cli
from model_kinds import BAD_MODEL_FILES, write_bad_model_files

# 32 fresh interpreters (torch imported in each): seconds each on an idle machine, more on a busy one.
pytestmark = pytest.mark.timeout(1500)
QUICK = ["--width", "32", "--height", "32", "--frames", "5", "--steps", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def files(tiny_models, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bad_files")
    legacy = folder / "legacy.pt"
    torch.save({"weight": torch.zeros(2)}, legacy, _use_new_zipfile_serialization=False)
    garbage = folder / "garbage.safetensors"
    garbage.write_bytes(b"this is not a model")
    truncated = folder / "truncated.safetensors"
    truncated.write_bytes(Path(tiny_models["vae"]).read_bytes()[:4096])
    a_file = folder / "a_file"
    a_file.write_text("x")
    return {"legacy": legacy, "garbage": garbage, "truncated": truncated, "a_file": a_file,
            "models": Path(tiny_models["t2v"]).parent.parent, **{k: Path(v) for k, v in tiny_models.items()},
            **write_bad_model_files(folder, Path(tiny_models["t2v"]))}


def _explicit(f, model=None, vae=None, text=None) -> list[str]:
    return ["--model", str(model or f["t2v"]), "--vae", str(vae or f["vae"]), "--text-encoder", str(text or f["text_encoder"])]


# (case id, extra flags (function of the file paths), message the one line must contain)
BAD_INPUTS = [
    ("width-not-8", lambda f: ["--width", "100"], "width 100 is not a positive multiple of 8 (nearest valid: 96 or 104)"),
    ("height-zero", lambda f: ["--height", "0"], "height 0 is not a positive multiple of 8 (nearest valid: 8)"),
    ("frames-negative", lambda f: ["--frames", "-5"], "frame count -5 is not of the form 4k+1 (nearest valid: 1)"),
    ("frames-not-4k+1", lambda f: ["--frames", "16"], "frame count 16 is not of the form 4k+1 (nearest valid: 13 or 17)"),
    ("steps-zero", lambda f: ["--steps", "0"], "steps must be an integer of at least 1, got 0"),
    ("shift-zero", lambda f: ["--shift", "0"], "shift must be a positive finite number, got 0.0"),
    ("shift-nan", lambda f: ["--shift", "nan"], "shift must be a positive finite number, got nan"),
    ("cfg-nan", lambda f: ["--cfg", "nan"], "the guidance scale (cfg) must be a finite number >= 0, got nan"),
    ("cfg-negative", lambda f: ["--cfg", "-1"], "the guidance scale (cfg) must be a finite number >= 0, got -1.0"),
    ("cfg-inf", lambda f: ["--cfg", "inf"], "the guidance scale (cfg) must be a finite number >= 0, got inf"),
    ("seed-negative", lambda f: ["--seed", "-1"], "seed -1 is not valid; valid: an integer from 0 to"),
    ("seed-too-big", lambda f: ["--seed", str(2**64)], f"seed {2**64} is not valid"),
    ("tp-vs-heads", lambda f: ["--world", "3", "--tp", "3"], "tp=3 does not divide the model's 4 attention heads"),
    ("ulysses-vs-heads", lambda f: ["--world", "3", "--ulysses", "3"], "tp x ulysses must divide 4"),
    ("world-not-multiple", lambda f: ["--world", "3", "--tp", "2"], "world=3 is not a multiple of cfg x ulysses x ring x tp"),
    ("world-zero", lambda f: ["--world", "0"], "world must be a positive integer, got 0"),
    ("model-missing", lambda f: _explicit(f, model=f["a_file"].parent / "nope.safetensors"), "--model"),
    ("model-is-a-vae", lambda f: _explicit(f, model=f["vae"]), "looks like a Wan VAE"),
    ("vae-is-a-transformer", lambda f: _explicit(f, vae=f["t2v"]), "--vae"),
    ("text-encoder-legacy-pickle", lambda f: _explicit(f, text=f["legacy"]), "is a legacy PyTorch pickle"),
    ("model-garbage", lambda f: _explicit(f, model=f["garbage"]), "not a valid safetensors file"),
    ("vae-truncated", lambda f: _explicit(f, vae=f["truncated"]), "the file is truncated or is not safetensors"),
    ("model-gguf-truncated", lambda f: _explicit(f, model=f["gguf_truncated"]),
     BAD_MODEL_FILES["gguf_truncated"][1]),
    ("model-fp8-scale-missing", lambda f: _explicit(f, model=f["fp8_scaled_missing_scale"]),
     BAD_MODEL_FILES["fp8_scaled_missing_scale"][1]),
    ("out-under-a-file", lambda f: ["--out", str(f["a_file"] / "x.mp4")], "x.mp4 cannot be written (File exists"),
    ("out-bad-suffix", lambda f: ["--out", "video.txt"], "--out video.txt has the suffix '.txt'; valid: .mp4"),
    ("save-latents-unwritable", lambda f: ["--save-latents", str(f["a_file"] / "l.safetensors")], "--save-latents"),
    ("vae-tile-not-8", lambda f: ["--vae-tile", "100"], "tile_px must be a positive multiple of the VAE's spatial factor 8"),
    ("overlap-without-tile", lambda f: ["--vae-overlap", "16"], "an overlap was given without a tile size"),
    ("fps-zero", lambda f: ["--fps", "0"], "fps 0 is not a usable frame rate"),
    ("memory-budget-negative", lambda f: ["--memory-budget-gb", "-1"], "memory_budget_gb must be a finite number of GB >= 0"),
    ("models-missing-folder", lambda f: ["--models", str(f["a_file"].parent / "no-such-tree")], "does not exist"),
    ("tree-without-vae", lambda f: ["--models", str(f["a_file"].parent), "--model", str(f["t2v"])],
     "or give the file with --vae"),
    ("device-cuda-absent", lambda f: ["--device", "cuda"], "--device cuda was asked for but this machine has no CUDA"),
]


def _case_args(flags: list[str], f, workdir: Path) -> list[str]:
    base = ["generate", "--prompt", "a fox", "--out", str(workdir / "out.mp4"), *QUICK]
    if "--model" not in flags and "--models" not in flags:
        base += ["--models", str(f["models"])]
    if flags[:2] == ["--models", ""]:
        flags = flags[2:]
    return base + flags


@pytest.fixture(scope="module")
def bad_input_results(files, tmp_path_factory) -> dict[str, dict]:
    """Every case run once, two at a time (each is a fresh interpreter)."""
    workdir = tmp_path_factory.mktemp("bad_inputs")

    def run(case):
        name, flags, _ = case
        return name, run_cli(_case_args(flags(files), files, workdir), workdir)

    with ThreadPoolExecutor(max_workers=2) as threads:
        results = dict(threads.map(run, BAD_INPUTS))
    report = "\n".join(f"{name:28s} exit {r['code']} {r['seconds']:5.1f} s  {r['stderr'].strip()[:150]}"
                       for name, r in results.items())
    print("\n" + report)
    assert not (workdir / "out.mp4").exists()
    return results


@pytest.mark.parametrize("name, flags, message", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line_before_any_worker(bad_input_results, name, flags, message):
    result = bad_input_results[name]
    lines = result["stderr"].strip().splitlines()
    assert result["code"] == 2, result["stderr"]
    assert len(lines) == 1 and lines[0].startswith("wanmesh: error: "), result["stderr"]
    assert message in lines[0]
    assert not result["pool_started"], "a worker pool was started for input a static check can refuse"



def test_prompt_tokens_beyond_512_are_counted_with_the_encoders_tokenizer(files):
    """The driver's count (tokenizer bytes read from the file header's tensor) against the worker's own
    tokenization of the same prompt (the text encoder as loaded for encoding)."""
    from wanmesh.parallel.weights.umt5_files import open_text_encoder
    from wanmesh.parallel.validation import count_prompt_tokens, prompt_length_warning
    import contextlib

    prompt = " ".join(f"fox{i} runs" for i in range(400))
    with contextlib.ExitStack() as stack:
        tokenizer = open_text_encoder(str(files["text_encoder"]), stack)[3]
        expected = len(tokenizer.encode(prompt)) + 1  # + EOS
    assert expected > 512
    assert count_prompt_tokens(prompt, files["text_encoder"]) == (expected, True)
    warning = prompt_length_warning(prompt, files["text_encoder"])
    assert f"is {expected} tokens" in warning and f"so {expected - 512} tokens at its end are dropped" in warning
    assert prompt_length_warning("a fox", files["text_encoder"]) is None
    tokens, exact = count_prompt_tokens(prompt, None)  # no tokenizer: an estimate, said to be one
    assert not exact and tokens > 512 and "about" in prompt_length_warning(prompt, None)


def test_full_disk_exits_1_leaves_no_video_and_keeps_the_latents(files, tmp_path):
    out, latents = tmp_path / "out" / "clip.mp4", tmp_path / "out" / "latents.safetensors"
    result = run_cli(["generate", "--models", str(files["models"]), "--prompt", "a fox", "--out", str(out),
                       "--save-latents", str(latents), *QUICK], tmp_path, {"WANMESH_TEST_FSIZE": "300"})
    lines = result["stderr"].strip().splitlines()
    assert result["code"] == 1, result["stderr"]
    assert lines[-1].startswith("wanmesh: error: ") and "File too large" in lines[-1], result["stderr"]
    assert "Traceback" not in result["stderr"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["latents.safetensors"]  # no partial or hidden file
    from safetensors.torch import load_file

    assert load_file(latents)["latents"].shape == (1, 16, 2, 4, 4)
    print(f"\nfull disk: exit {result['code']} in {result['seconds']:.1f} s: {lines[-1]}")


def test_failed_decode_keeps_the_saved_latents(files, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    from wanmesh.parallel.cli import main
    from wanmesh.parallel.driver.runner import PoolRunner
    from wanmesh.parallel.errors import WorkerError

    def failing_decode(self, *args, **kwargs):
        raise WorkerError(0, "RuntimeError", "decode failed on purpose", "Traceback (most recent call last): ...")

    monkeypatch.setattr(PoolRunner, "decode", failing_decode)
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    out, latents = tmp_path / "clip.mp4", tmp_path / "latents.safetensors"
    code = main(["generate", "--models", str(files["models"]), "--prompt", "a fox", "--out", str(out),
                 "--save-latents", str(latents), *QUICK])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and error == "wanmesh: error: rank 0: RuntimeError: decode failed on purpose"
    assert load_file(latents)["latents"].shape == (1, 16, 2, 4, 4) and not out.exists()


def sampling_cli(models: Path, workdir: Path, *flags: str) -> tuple[subprocess.Popen, bytes]:
    """A long `generate` on the tiny models, returned once it reports its first step (with its stderr so far)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANMESH_WORKER_THREADS": "1"}
    args = ["generate", "--models", str(models), "--prompt", "a fox", "--out", str(workdir / "x.mp4"),
            *QUICK[:-4], "--steps", "500", "--device", "cpu", *flags]
    proc = subprocess.Popen([sys.executable, str(LAUNCHER), *args], stderr=subprocess.PIPE, env=env, cwd=workdir)
    seen = b""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while b"step 1/" not in seen and time.monotonic() < deadline and proc.poll() is None:
        seen += os.read(proc.stderr.fileno(), 4096)
    assert b"step 1/" in seen, seen.decode()
    return proc, seen


def test_ctrl_c_exits_130_with_one_line(files, tmp_path):
    proc, seen = sampling_cli(files["models"], tmp_path)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=60)[1]
    stopped = time.monotonic() - sent
    lines = [line for line in (seen + rest).decode().replace("\r", "\n").splitlines() if line.strip()]
    assert proc.returncode == 130 and lines[-1] == "interrupted", (seen + rest).decode()
    assert "Traceback" not in (seen + rest).decode()
    print(f"\nCtrl-C: exit 130 {stopped:.1f} s after SIGINT")
