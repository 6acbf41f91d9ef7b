"""The video writer and reader (parallel/video_io.py) and the save-video node (nodes/video.py).

Round trips are checked against the input frames and against PyAV's own view of the file (frame count, size,
rate); failures (unwritable folder, a full disk simulated with RLIMIT_FSIZE, a file that does not read back
right, bad input) must leave nothing under the final name and no temporary file behind.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import types
from fractions import Fraction

import av
import pytest
import torch

from wanmesh.parallel import video_io
from wanmesh.parallel.video_io import read_video, write_video


def _smooth_frames(count: int, height: int, width: int) -> torch.Tensor:
    """Gradients that drift from frame to frame: easy for H.264, so the round trip should be close."""
    y = torch.linspace(0, 1, height).view(1, height, 1)
    x = torch.linspace(0, 1, width).view(1, 1, width)
    t = torch.arange(count, dtype=torch.float32).view(count, 1, 1) / max(count, 1)
    channels = [0.2 + 0.6 * (0.5 * x + 0.5 * y) * torch.ones_like(t),
                0.5 + 0.3 * torch.sin(6.28 * (x + t)) * torch.ones_like(y),
                0.3 + 0.4 * y * (1 - t)]
    return torch.stack([c.expand(count, height, width) for c in channels], dim=-1).contiguous()


def _probe(path) -> dict:
    """What PyAV itself says about the file, independent of read_video."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        decoded = sum(1 for _ in container.decode(stream))
        return {"frames": decoded, "width": stream.codec_context.width, "height": stream.codec_context.height,
                "rate": stream.average_rate, "codec": stream.codec_context.name, "pix_fmt": stream.codec_context.pix_fmt}


@pytest.mark.parametrize("fps, expected_rate", [(16, Fraction(16)), (23.976, Fraction(2997, 125))])
def test_written_video_reopens_with_its_frames_size_rate_and_pixels(tmp_path, fps, expected_rate):
    frames = _smooth_frames(9, 48, 64)
    path = write_video(frames, tmp_path / "new" / "deeper" / "clip.mp4", fps)
    assert path == tmp_path / "new" / "deeper" / "clip.mp4"
    probe = _probe(path)
    assert probe["frames"] == 9 and (probe["width"], probe["height"]) == (64, 48)
    assert probe["rate"] == expected_rate
    assert probe["codec"] == "h264" and probe["pix_fmt"] == "yuv420p"
    back = read_video(path)
    assert back.shape == frames.shape and back.dtype == torch.float32
    assert float((back - frames).abs().mean()) < 0.03
    assert sorted(os.listdir(path.parent)) == ["clip.mp4"]  # no temporary file left


def test_an_existing_file_is_replaced_whole(tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(b"an older video")
    write_video(_smooth_frames(5, 32, 32), path, 8)
    assert _probe(path)["frames"] == 5 and sorted(os.listdir(tmp_path)) == ["clip.mp4"]


def test_unwritable_folder_raises_oserror_and_leaves_nothing(tmp_path):
    if os.geteuid() == 0:  # root ignores folder permissions: make the parent a regular file instead
        blocker = tmp_path / "a_file"
        blocker.write_bytes(b"not a folder")
        target = blocker / "clip.mp4"
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        target = locked / "clip.mp4"
    try:
        with pytest.raises(OSError):
            write_video(_smooth_frames(5, 32, 32), target, 16)
        assert not target.exists()
        assert sorted(p.name for p in tmp_path.rglob("*")) in (["a_file"], ["locked"])
    finally:
        if target.parent.is_dir():
            target.parent.chmod(0o700)


FULL_DISK_SCRIPT = textwrap.dedent("""
    import json, resource, signal, sys, torch
    from wanmesh.parallel.video_io import write_video
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
    frames = torch.rand(12, 128, 128, 3, generator=torch.Generator().manual_seed(0))  # noise: far above 20 kB
    try:
        write_video(frames, sys.argv[1], 16)
    except OSError as error:
        print(json.dumps({"oserror": True, "errno": error.errno}))
    except BaseException as error:
        print(json.dumps({"oserror": False, "type": type(error).__name__, "message": str(error)}))
    else:
        print(json.dumps({"oserror": False, "type": None}))
""")


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_full_disk_raises_the_os_error_and_keeps_the_old_file(tmp_path):
    target = tmp_path / "clip.mp4"
    target.write_bytes(b"the previous video")
    result = subprocess.run([sys.executable, "-c", FULL_DISK_SCRIPT, str(target)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"oserror": True, "errno": errno.EFBIG}
    assert target.read_bytes() == b"the previous video"  # never overwritten by a partial file
    assert sorted(os.listdir(tmp_path)) == ["clip.mp4"]  # and the temporary file is gone


def test_a_file_that_does_not_read_back_right_is_not_kept(tmp_path, monkeypatch):
    real_encode = video_io._encode
    monkeypatch.setattr(video_io, "_encode", lambda pixels, path, rate, crf: real_encode(pixels[:-1], path, rate, crf))
    with pytest.raises(RuntimeError, match="gave 4 frames of 32x32; expected 5 frames of 32x32"):
        write_video(_smooth_frames(5, 32, 32), tmp_path / "clip.mp4", 16)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("frames, fps, message", [
    (torch.zeros(5, 48, 65, 3), 16, "frame size 65x48 (width x height) cannot be written as H.264 yuv420p"),
    (torch.zeros(5, 47, 64, 3), 16, "frame size 64x47 (width x height) cannot be written as H.264 yuv420p"),
    (torch.zeros(5, 48, 64, 4), 16, "frames must be a tensor [frames, height, width, 3]"),
    (torch.zeros(0, 48, 64, 3), 16, "with at least one frame, got [0, 48, 64, 3]"),
    (torch.zeros(5, 48, 64, 3), 0, "fps 0 is not a usable frame rate"),
    (torch.zeros(5, 48, 64, 3), float("nan"), "fps nan is not a usable frame rate"),
])
def test_bad_input_gives_one_line_and_writes_nothing(tmp_path, frames, fps, message):
    with pytest.raises(ValueError) as error:
        write_video(frames, tmp_path / "out" / "clip.mp4", fps)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert os.listdir(tmp_path) == []


def test_unknown_suffix_and_bad_crf_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"suffix '\.gif'; valid: \.mp4"):
        write_video(torch.zeros(1, 16, 16, 3), tmp_path / "clip.gif", 16)
    with pytest.raises(ValueError, match="crf 60 is not an H.264 quality"):
        write_video(torch.zeros(1, 16, 16, 3), tmp_path / "clip.mp4", 16, crf=60)
    assert os.listdir(tmp_path) == []


def _stub_folder_paths(output_dir) -> types.ModuleType:
    """ComfyUI's folder_paths reduced to what a save node uses, with the same signature and return tuple."""
    module = types.ModuleType("folder_paths")

    def get_save_image_path(filename_prefix, output_dir, image_width=0, image_height=0):
        prefix = filename_prefix.replace("%width%", str(image_width)).replace("%height%", str(image_height))
        subfolder, filename = os.path.split(os.path.normpath(prefix))
        folder = os.path.join(output_dir, subfolder)
        os.makedirs(folder, exist_ok=True)
        taken = [f for f in os.listdir(folder) if f.startswith(filename + "_")]
        return folder, filename, len(taken) + 1, subfolder, prefix

    module.get_output_directory = lambda: str(output_dir)
    module.get_save_image_path = get_save_image_path
    return module


def test_save_video_node_writes_numbered_files_and_returns_a_video_ui(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "folder_paths", _stub_folder_paths(tmp_path))
    from wanmesh.nodes.video import WanMeshSaveVideo

    node = WanMeshSaveVideo()
    frames = _smooth_frames(5, 48, 64)
    first = getattr(node, WanMeshSaveVideo.FUNCTION)(images=frames, fps=16.0, filename_prefix="clips/fox_%width%")
    second = getattr(node, WanMeshSaveVideo.FUNCTION)(images=frames, fps=16.0, filename_prefix="clips/fox_%width%")
    entry = {"subfolder": "clips", "type": "output"}  # the keys of ComfyUI's own SaveVideo result
    assert first == {"ui": {"images": [{"filename": "fox_64_00001_.mp4", **entry}], "animated": (True,)}}
    assert second["ui"]["images"][0]["filename"] == "fox_64_00002_.mp4"
    assert sorted(os.listdir(tmp_path / "clips")) == ["fox_64_00001_.mp4", "fox_64_00002_.mp4"]
    probe = _probe(tmp_path / "clips" / "fox_64_00001_.mp4")
    assert (probe["frames"], probe["width"], probe["height"], probe["rate"]) == (5, 64, 48, 16)


def test_save_video_node_follows_the_classic_node_api():
    from wanmesh.nodes.video import WanMeshSaveVideo

    inputs = WanMeshSaveVideo.INPUT_TYPES()["required"]
    assert WanMeshSaveVideo.OUTPUT_NODE is True and WanMeshSaveVideo.RETURN_TYPES == ()
    assert WanMeshSaveVideo.CATEGORY == "WanMesh/video" and WanMeshSaveVideo.DESCRIPTION
    assert {name: spec[0] for name, spec in inputs.items()} == {"images": "IMAGE", "fps": "FLOAT",
                                                                "filename_prefix": "STRING"}
    assert all(spec[1].get("tooltip") for spec in inputs.values())
    assert inputs["fps"][1]["default"] == 16 and inputs["filename_prefix"][1]["default"] == "WanMesh"


def test_without_h264_encoders_it_falls_back_to_mpeg4_with_a_warning(tmp_path, monkeypatch, caplog):
    real_codec = av.Codec

    def codec_without_h264(name, mode="r"):
        if name in video_io.H264_ENCODERS:
            raise av.codec.codec.UnknownCodecError(name)
        return real_codec(name, mode)

    monkeypatch.setattr(av, "Codec", codec_without_h264)
    video_io.video_encoder.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=video_io.__name__):
            path = write_video(_smooth_frames(5, 32, 32), tmp_path / "clip.mp4", 16)
        assert video_io.video_encoder() == "mpeg4" and "no libx264 encoder" in caplog.text
    finally:
        video_io.video_encoder.cache_clear()
    probe = _probe(path)
    assert (probe["codec"], probe["frames"]) == ("mpeg4", 5)
    assert float((read_video(path) - _smooth_frames(5, 32, 32)).abs().mean()) < 0.05
