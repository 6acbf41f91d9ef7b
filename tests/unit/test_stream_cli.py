"""`wanmesh stream` end to end on the tiny models: each chunk lands in --chunk-dir as its own MP4 with the frame
count the Wan VAE gives that chunk, the whole video and the latents are written, and every bad option (or
combination) exits with code 2 and one line before any model file is touched or any pool starts."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from wanmesh.parallel import read_video
from wanmesh.parallel.cli import main
from wanmesh.parallel.cli import stream as stream_module


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from wanmesh.parallel.tiny.models import make_tiny

    root = tmp_path_factory.mktemp("tiny")
    make_tiny(root)
    return root


def test_stream_writes_each_chunk_then_the_whole_video(models, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    out, chunk_dir, latents = tmp_path / "video.mp4", tmp_path / "chunks", tmp_path / "latents.safetensors"
    status = main(["stream", "--models", str(models), "--prompt", "a fox", "--width", "32", "--height", "32",
                   "--frames", "17", "--chunk", "2", "--steps", "2", "--seed", "3", "--device", "cpu",
                   "--out", str(out), "--chunk-dir", str(chunk_dir), "--save-latents", str(latents)])
    assert status == 0
    printed = capsys.readouterr().out
    # 5 latent frames in chunks of 2: 2 + 2 + 1 -> 4*2-3, 4*2 and 4*1 image frames
    expected = [5, 8, 4]
    files = sorted(chunk_dir.glob("chunk_*.mp4"))
    assert [f.name for f in files] == ["chunk_000.mp4", "chunk_001.mp4", "chunk_002.mp4"]
    chunk_frames = [read_video(f) for f in files]
    assert [f.shape[0] for f in chunk_frames] == expected
    assert len(re.findall(r"^chunk \d: .* s \(since start", printed, flags=re.M)) == 3
    whole = read_video(out)
    assert whole.shape == (17, 32, 32, 3)
    # the chunk files joined show the same frames as the whole video (both lossy H.264 of the same frames)
    assert (torch.cat(chunk_frames) - whole).abs().mean() < 0.03
    assert load_file(str(latents))["latents"].shape == (1, 16, 5, 4, 4)


def test_stream_from_an_image_starts_with_its_latent_frame(models, tmp_path, capsys, monkeypatch):
    """--image: the start image resized and center-cropped (as ARVideoI2V), encoded by the pool's VAE to the first
    latent frame (chunk 0, one frame), the chunks after it generated; the same image encoded here gives that frame."""
    from PIL import Image

    from wanmesh.parallel.cli.media import read_image
    from wanmesh.parallel.image_to_video import stream_start_frame
    from wanmesh.parallel.tiny.files import TINY_FILES
    from wanmesh.parallel.worker.executors import RankExecutor

    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    image = tmp_path / "start.png"
    pixels = torch.rand(40, 56, 3, generator=torch.Generator().manual_seed(1))  # another size and aspect
    Image.fromarray((pixels * 255).round().to(torch.uint8).numpy()).save(image)
    out, chunk_dir, latents = tmp_path / "video.mp4", tmp_path / "chunks", tmp_path / "latents.safetensors"
    status = main(["stream", "--models", str(models), "--prompt", "a fox", "--width", "32", "--height", "32",
                   "--frames", "17", "--chunk", "2", "--steps", "2", "--seed", "3", "--device", "cpu",
                   "--image", str(image), "--out", str(out), "--chunk-dir", str(chunk_dir),
                   "--save-latents", str(latents)])
    assert status == 0, capsys.readouterr().err
    files = sorted(chunk_dir.glob("chunk_*.mp4"))
    assert [read_video(f).shape[0] for f in files] == [1, 8, 8]  # the start frame, then 2 + 2 latent frames
    engine = RankExecutor("cpu")
    vae = engine.load_vae(str(models / TINY_FILES["vae"]))
    expected = engine.encode(vae, stream_start_frame(read_image(image), 32, 32))
    got = load_file(str(latents))["latents"]
    torch.testing.assert_close(got[:, :, :1], expected, rtol=1e-5, atol=1e-5)
    assert read_video(out).shape == (17, 32, 32, 3)


COMMON = ["stream", "--prompt", "a fox", "--width", "32", "--height", "32", "--frames", "25", "--chunk", "2",
          "--steps", "2", "--seed", "3", "--device", "cpu"]


def _saved_latents(models, tmp_path, capsys, variants: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """The latents `wanmesh stream` (COMMON) saves with each variant's extra flags."""
    latents = {}
    for name, extra in variants.items():
        out = tmp_path / name
        assert main([*COMMON, "--models", str(models), *extra, "--out", str(out / "v.mp4"), "--chunk-dir",
                     str(out / "chunks"), "--save-latents", str(out / "latents.safetensors")]) == 0, capsys.readouterr().err
        latents[name] = load_file(str(out / "latents.safetensors"))["latents"]
    return latents


def _in_process(models, switch_texts: dict[int, str] | None = None, **fields) -> torch.Tensor:
    """COMMON's stream on one device in this process, with StreamSample ``fields`` and prompt switches."""
    from wanmesh.parallel.protocol import StreamSample
    from wanmesh.parallel.tiny.files import TINY_FILES
    from wanmesh.parallel.worker.executors import RankExecutor

    engine = RankExecutor("cpu")
    text = engine.load_text_encoder(str(models / TINY_FILES["text_encoder"]))
    model = engine.load_model(str(models / TINY_FILES["model"]))
    switches = switch_texts or {}
    request = StreamSample(handle=model, latent=torch.zeros(1, 16, 7, 4, 4), positive=engine.encode_text(text, ["a fox"]),
                           negative=[], seed=3, steps=2, chunk=2, switch_chunks=list(switches),
                           switch_positive=[engine.encode_text(text, [t]) for t in switches.values()], **fields)
    return engine.stream(request)[0]


def test_prompt_at_switches_the_prompt_as_the_request_in_process(models, tmp_path, capsys, monkeypatch):
    """--prompt-at 2:PROMPT: the saved latents are the in-process stream's with that switch (the prompts encoded by
    the same text encoder), the chunks before it are the unswitched stream's."""
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    latents = _saved_latents(models, tmp_path, capsys, {"plain": [], "switched": ["--prompt-at", "2:a red balloon rises"]})
    expected = _in_process(models, {2: "a red balloon rises"})
    torch.testing.assert_close(latents["switched"], expected, rtol=0, atol=1e-5)
    assert (latents["switched"][:, :, :4] - latents["plain"][:, :, :4]).abs().max() == 0
    assert (latents["switched"][:, :, 4:] - latents["plain"][:, :, 4:]).abs().max() > 1e-2


def test_reanchor_on_ulysses_2_equals_the_one_device_stream_in_process(models, tmp_path, capsys, monkeypatch):
    """--kv-window 3 --sink 1 --reanchor on a 2-rank Ulysses pool: the saved latents are the in-process world-1
    stream's with the same window re-anchored; the chunks before the window rolls are the plain window's."""
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    window = ["--kv-window", "3", "--sink", "1"]
    latents = _saved_latents(models, tmp_path, capsys, {
        "plain": window, "reanchored": [*window, "--reanchor", "--world", "2", "--ulysses", "2"]})
    expected = _in_process(models, kv_window=3, sink=1, reanchor=True)
    torch.testing.assert_close(latents["reanchored"], expected, rtol=0, atol=1e-5)
    assert (latents["reanchored"][:, :, :2] - latents["plain"][:, :, :2]).abs().max() < 1e-5  # before the roll
    assert (latents["reanchored"][:, :, 4:] - latents["plain"][:, :, 4:]).abs().max() > 1e-3


def test_live_prompts_from_standard_input_switch_where_the_command_says(models, tmp_path, capsys, monkeypatch):
    """--live-prompts with a line on standard input: the command prints the chunk where it applied, and the saved
    latents are the in-process stream's with a switch to that line at that chunk."""
    import io
    import re

    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    monkeypatch.setattr("sys.stdin", io.StringIO("\na red balloon rises\n"))
    saved = tmp_path / "latents.safetensors"
    assert main([*COMMON, "--models", str(models), "--live-prompts", "--out", str(tmp_path / "v.mp4"),
                 "--chunk-dir", str(tmp_path / "chunks"), "--save-latents", str(saved)]) == 0, capsys.readouterr().err
    said = re.findall(r"prompt switched at chunk (\d+): a red balloon rises", capsys.readouterr().err)
    assert len(said) == 1, "the command did not say where the prompt applied"
    expected = _in_process(models, {int(said[0]): "a red balloon rises"})
    torch.testing.assert_close(load_file(str(saved))["latents"], expected, rtol=0, atol=1e-5)


BAD = [
    (["--chunk", "0"], "chunk must be a whole number of latent frames >= 1, got 0"),
    (["--chunk", "3", "--kv-window", "2"], "kv_window=2 latent frames is smaller than a chunk of 3"),
    (["--chunk", "2", "--kv-window", "3", "--sink", "4"], "sink=4 is larger than kv_window=3"),
    (["--reanchor"], "reanchor moves the pinned sink frames of a rolling window, but kv_window=None and sink=0"),
    (["--kv-window", "6", "--sink", "1", "--reanchor", "--no-kv-cache"], "reanchor turns the keys held in the KV cache"),
    (["--frames", "16"], "frame"),
    (["--timesteps", "250,500"], "timesteps must be a non-empty, strictly descending list"),
    (["--timesteps", "1000,x"], "timesteps must be a comma list of numbers"),
    (["--world", "2", "--ulysses", "3"], "ulysses"),
    (["--cfg", "-1"], "guidance scale"),
    (["--image", "missing.png"], "--image"),
    (["--frames", "1", "--image", "missing.png"], "nothing is left to generate"),
    (["--prompt-at", "two:a cat"], "--prompt-at 'two:a cat' is not valid; valid: CHUNK:PROMPT"),
    (["--prompt-at", "1:"], "--prompt-at '1:' is not valid"),
    (["--prompt-at", "1:a cat", "--prompt-at", "1:a dog"], "--prompt-at gives chunk 1 twice"),
    (["--frames", "17", "--chunk", "3", "--prompt-at", "2:a cat"],
     "a prompt switch at chunk 2 is not valid for a stream of 2 chunks of 3 latent frames; valid: 1 to 1"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_options_exit_2_with_one_line_before_any_work(extra, message, tmp_path, capsys, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("model files or the pool were touched before the options were checked")

    monkeypatch.setattr(stream_module, "WorkerPool", no_work)
    monkeypatch.setattr("wanmesh.parallel.cli.resolve_model_files", no_work)
    code = main(["stream", "--prompt", "x", "--out", str(tmp_path / "v.mp4"), "--chunk-dir", str(tmp_path / "c"), *extra])
    assert code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.startswith("wanmesh: error:")
    assert message in error
    assert not (tmp_path / "c").exists()


def test_bench_stream_reports_the_prompt_switch_cost_of_each_layout(tmp_path, capsys):
    """`wanmesh bench stream`: world 1 and Ulysses 2 rows, each fused row with its prompt switch measured (the
    chunks it re-encoded counted by the sampler: every chunk before the switch, as no KV window is set), in the
    table and the JSON."""
    import json

    out = tmp_path / "bench.json"
    assert main(["bench", "stream", "--width", "32", "--height", "32", "--frames", "25", "--chunk", "2",
                 "--steps", "2", "--repeats", "1", "--plot", str(tmp_path / "bench.png"), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["world"] for row in rows] == [1, 2, 2]
    switched = [row for row in rows if "switch" in row]
    assert [row["fused"] for row in switched] == [True, True]
    for row in switched:
        assert row["switch"]["chunk"] == 2 and row["switch"]["recached_chunks"] == 2  # 4 chunks of 2: the middle
        median, low, high = row["switch"]["extra_s"]
        assert low <= median <= high
    table = capsys.readouterr().out
    assert "world 1: a prompt switch before chunk 2 re-encodes 2 earlier chunk(s)" in table
    assert (tmp_path / "bench.png").stat().st_size > 0
