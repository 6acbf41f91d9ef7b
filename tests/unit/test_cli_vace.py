"""`wanmesh generate` with VACE flags and `wanmesh bench dit --vace`, end to end on the tiny models.

The saved VACE context is compared with `vace/encode.encode_vace` run in this process (RankExecutor) on inputs
the test derives itself with OpenCV; masks and shapes are checked against hand-computed values; bad inputs
must fail with exit code 2 and one line before any worker pool is made.
"""

from __future__ import annotations

import re

import cv2
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from wanmesh.parallel.cli import generate as generate_module
from wanmesh.parallel.cli import main
from wanmesh.parallel.cli.media import read_frames, read_mask
from wanmesh.parallel.protocol import EncodeVace
from wanmesh.parallel.worker.executors import RankExecutor

WIDTH, HEIGHT, FRAMES = 64, 48, 5


def _write_mp4(path, width: int, height: int, frames: int) -> None:
    """A square with a bright border moving right over a dark, textured background (edges for Canny)."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 8, (width, height))
    for index in range(frames):
        frame = np.full((height, width, 3), 30, np.uint8)
        frame[::8, :] = 90
        x = 4 + 6 * index
        frame[8:32, x:x + 24] = (40, 200, 240)
        frame[12:28, x + 4:x + 20] = (200, 60, 20)
        writer.write(frame)
    writer.release()


def _read_mp4_rgb(path) -> list[np.ndarray]:
    """The MP4's frames as RGB uint8, read with OpenCV here (not through the CLI's reader)."""
    capture, frames = cv2.VideoCapture(str(path)), []
    while True:
        ok, frame = capture.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    capture.release()
    return frames


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vace_media")
    _write_mp4(folder / "clip.mp4", WIDTH, HEIGHT, FRAMES)
    _write_mp4(folder / "small.mp4", 48, 32, FRAMES)
    rng = np.random.default_rng(3)
    for index in range(2):
        cv2.imwrite(str(folder / f"ref{index}.png"), rng.integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8))
    return folder


def _tree(tiny_models):
    return tiny_models["t2v"].parent.parent


def _generate(tiny_models, out, *flags: str) -> None:
    main(["generate", "--models", str(_tree(tiny_models)), "--prompt", "a fox in the snow", "--negative", "blurry",
          "--steps", "2", "--seed", "3", "--device", "cpu", "--out", str(out), *flags])


def _expected_context(tiny_models, media):
    """encode_vace in this process for the same inputs: Canny of the MP4 (OpenCV here) and the two PNGs."""
    grey = [cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY) for frame in _read_mp4_rgb(media / "clip.mp4")]
    edges = np.stack([cv2.Canny(g, 100, 200) for g in grey]).astype(np.float32) / 255.0
    control = torch.from_numpy(edges)[..., None].expand(-1, -1, -1, 3).contiguous()
    references = torch.stack([torch.from_numpy(cv2.cvtColor(cv2.imread(str(media / f"ref{i}.png")),
                                                            cv2.COLOR_BGR2RGB).astype(np.float32) / 255.0)
                              for i in range(2)])  # already the canvas size: fitting on white changes nothing
    executor = RankExecutor("cpu")
    vae = executor.load_vae(str(tiny_models["vae"]))
    return executor.encode_vace(EncodeVace(handle=vae, width=WIDTH, height=HEIGHT, length=FRAMES,
                                           control_video=control, reference_images=references))


def test_generate_with_references_and_canny_control_saves_the_native_context(tiny_models, media, tmp_path):
    _generate(tiny_models, tmp_path / "out.mp4", "--width", str(WIDTH), "--height", str(HEIGHT), "--frames",
              str(FRAMES), "--vace-video", str(media / "clip.mp4"), "--vace-control", "canny",
              "--vace-ref", str(media / "ref0.png"), "--vace-ref", str(media / "ref1.png"),
              "--save-vace", str(tmp_path / "vace.safetensors"), "--save-latents", str(tmp_path / "latents.safetensors"),
              "--save-frames", str(tmp_path / "frames.safetensors"))
    saved = load_file(tmp_path / "vace.safetensors")
    latents = load_file(tmp_path / "latents.safetensors")["latents"]
    assert saved["vace_frames"].shape == (1, 32, 2 + 2, 6, 8) and saved["vace_mask"].shape == (1, 64, 2 + 2, 6, 8)
    assert latents.shape == (1, 16, 2, 6, 8)  # the two reference frames are trimmed
    assert load_file(tmp_path / "frames.safetensors")["frames"].shape == (FRAMES, HEIGHT, WIDTH, 3)
    # references are kept (mask 0); without a mask every video pixel is generated (mask 1)
    assert torch.all(saved["vace_mask"][:, :, :2] == 0) and torch.all(saved["vace_mask"][:, :, 2:] == 1)
    frames, mask, trim = _expected_context(tiny_models, media)
    assert trim == 2
    torch.testing.assert_close(saved["vace_frames"], frames)
    torch.testing.assert_close(saved["vace_mask"], mask)
    video = _read_mp4_rgb(tmp_path / "out.mp4")
    assert len(video) == FRAMES and video[0].shape == (HEIGHT, WIDTH, 3)


def test_outpaint_grows_the_canvas_and_masks_the_padding(tiny_models, media, tmp_path):
    _generate(tiny_models, tmp_path / "wide.mp4", "--vace-video", str(media / "small.mp4"), "--outpaint", "8,8,8,8",
              "--save-vace", str(tmp_path / "vace.safetensors"))
    video = _read_mp4_rgb(tmp_path / "wide.mp4")
    assert len(video) == FRAMES and video[0].shape == (32 + 16, 48 + 16, 3)  # size and length from the padded video
    mask = load_file(tmp_path / "vace.safetensors")["vace_mask"]
    assert mask.shape == (1, 64, 2, 6, 8)
    # 8 px of padding = exactly the outer ring of 8x8 blocks: generated (1); the original video inside: kept (0)
    ring = torch.ones(6, 8, dtype=torch.bool)
    ring[1:-1, 1:-1] = False
    assert torch.all(mask[..., ring] == 1) and torch.all(mask[..., ~ring] == 0)


class _NoPool:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a worker pool was started for bad input")


@pytest.mark.parametrize("flags, message", [
    (["--vace-video", "{media}/missing.mp4"], "--vace-video {media}/missing.mp4 does not exist"),
    (["--vace-video", "{media}/clip.mp4", "--outpaint", "8,8,8"], "--outpaint takes 4 comma-separated whole numbers"),
    (["--vace-video", "{media}/small.mp4", "--outpaint", "8,8,8,0"],
     "padded size 64x40 (width x height) must be multiples of 16"),
    (["--vace-video", "{media}/clip.mp4", "--extend-keep", "4,3", "--frames", "9"],
     "keep_first 4 + keep_last 3 = 7 frames, but the video has only 5"),
    (["--vace-video", "{media}/clip.mp4", "--vace-strength", "nan"], "vace_strength[0] is nan"),
    (["--vace-ref", "{media}/ref0.png", "--model", "{t2v}", "--vae", "{vae}", "--text-encoder", "{text_encoder}"],
     "--vace-ref needs a VACE model, but --model {t2v} is a Wan text-to-video transformer"),
])
def test_bad_vace_input_exits_2_with_one_line_before_any_pool(tiny_models, media, tmp_path, monkeypatch, capsys,
                                                               flags, message):
    monkeypatch.setattr(generate_module, "WorkerPool", _NoPool)
    names = {"media": media, **{key: tiny_models[key] for key in ("t2v", "vae", "text_encoder")}}
    flags = [flag.format(**names) for flag in flags]
    models = [] if "--model" in flags else ["--models", str(_tree(tiny_models))]
    code = main(["generate", *models, "--prompt", "x", "--device", "cpu", "--out", str(tmp_path / "x.mp4"), *flags])
    error = capsys.readouterr().err
    assert code == 2
    assert error.startswith("wanmesh: error: ") and error.count("\n") == 1 and "Traceback" not in error
    assert message.format(**names) in error
    assert not (tmp_path / "x.mp4").exists()


def test_media_reads_folders_in_name_order_and_masks_by_luminance(tmp_path):
    rng = np.random.default_rng(5)
    frames = rng.integers(0, 256, (3, 16, 24, 3), dtype=np.uint8)  # RGB
    (tmp_path / "frames").mkdir()
    for name, frame in zip(("b_001.png", "b_002.png", "a_999.png"), frames):
        cv2.imwrite(str(tmp_path / "frames" / name), frame[:, :, ::-1])
    read = read_frames(tmp_path / "frames")
    expected = frames[[2, 0, 1]].astype(np.float32) / 255.0  # sorted by name: a_999, b_001, b_002
    np.testing.assert_allclose(read.numpy(), expected, atol=1e-7)
    mask = read_mask(tmp_path / "frames" / "a_999.png")
    luminance = expected[:1] @ np.array([0.299, 0.587, 0.114], dtype=np.float32)  # BT.601, written out here
    assert mask.shape == (1, 16, 24)
    np.testing.assert_allclose(mask.numpy(), luminance, atol=1e-5)


def test_bench_dit_vace_prints_the_step_and_encode_rows(tiny_models, capsys):
    main(["bench", "dit", "--vace", "--models", str(_tree(tiny_models)), "--device", "cpu", "--repeats", "1",
          "--size", "64x48x5", "--encode-size", "64x48x5"])
    out = capsys.readouterr().out
    assert "64x48, 5 frames, latents [1, 16, 2, 6, 8]" in out
    number = r"\s+\d+\.\d+"
    for row in ("WanMesh denoise step (T2V)", "WanMesh step with live preview", "VACE denoise step, 1 context",
                "VACE denoise step, 2 contexts"):
        assert re.search(re.escape(row) + number * 3, out), row
    for row in ("ratio 1 context / T2V", "ratio 2 contexts / T2V"):
        assert re.search(re.escape(row) + number, out), row
    encode_rows = {tuple(m.split()[:4]) for m in re.findall(r"^\s+\d+\s+\d+\s+\w+\s+[\d-]+(?:\s+\d+\.\d+){3}$", out,
                                                                 flags=re.M)}
    assert encode_rows == {("1", "1", "whole", "-"), ("1", "1", "32", "8"), ("2", "2", "32", "8"),
                           ("1", "1", "64", "16"), ("2", "2", "64", "16")}


def test_a_control_video_shorter_than_frames_is_padded_with_grey_and_said_once(tiny_models, media, tmp_path, capsys):
    """As native WanVaceToVideo: the 5-frame video is padded with grey frames to --frames 9, in one stderr line."""
    _generate(tiny_models, tmp_path / "long.mp4", "--vace-video", str(media / "clip.mp4"), "--frames", "9",
              "--save-vace", str(tmp_path / "vace.safetensors"))
    said = [line for line in capsys.readouterr().err.splitlines() if "VACE:" in line]
    assert said == ["wanmesh: VACE: the control video has 5 frames: padded to 9 with grey frames, as ComfyUI's "
                    "WanVaceToVideo does"], said
    assert load_file(tmp_path / "vace.safetensors")["vace_frames"].shape == (1, 32, 3, 6, 8)
    assert len(_read_mp4_rgb(tmp_path / "long.mp4")) == 9
