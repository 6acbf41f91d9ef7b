"""`wanmesh generate --control-video` against the native Fun Control conditioning, on the tiny files.

The conditioning the command line builds from a control video and an image (resized and center-cropped: they have
other sizes and aspects than the video, and the control video is shorter) equals what native
``WanFunControlToVideo`` (Wan 2.1 Fun Control: control video and start image) and ``Wan22FunControlToVideo`` (Wan
2.2 Fun Control: control video and reference image) build from the same frames on the same VAE file, run in a
subprocess inside the recent ComfyUI copy; for Wan 2.2 Fun 5B Control, native ``Wan22FunControlToVideo`` on the tiny
Wan 2.2 VAE (48-channel latents at 16x; native builds ComfyUI's Wan 2.2 VAE at the widths the tiny file holds, as
``test_native_vae22.py`` does: ComfyUI builds every Wan 2.2 VAE at the release widths). The command itself (Wan 2.2
Fun Control A14B and Fun 5B Control, a control video file) saves the latents of a SampleRequest built here from that
conditioning. Mistakes are one line and exit code 2 before any pool.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from native_scripts import NATIVE_VAE22
from test_native_sampling import TOLERANCE, largest_difference

from wanmesh.parallel.cli import generate as generate_module
from wanmesh.parallel.cli import main
from wanmesh.parallel.cli.image_inputs import ImageInputs
from wanmesh.parallel.cli.media import read_frames, read_image
from wanmesh.parallel.protocol import SampleRequest
from wanmesh.parallel.tiny.files import TINY_FILES
from wanmesh.parallel.worker.executors import RankExecutor

WIDTH, HEIGHT, FRAMES, STEPS, SEED = 48, 32, 9, 2, 3
FUN21, FUN22, FUN22_5B = 48, 52, 148  # the models' input channels
WIDTH_5B = 64  # Fun 5B: a 2 x 4 latent at 16x

NATIVE = r"""
import sys
vae_file, io_file, width, height, length, vae22_file, width_5b = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]), \
    sys.argv[6], int(sys.argv[7])
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
""" + NATIVE_VAE22 + r"""
import torch, comfy.sd, comfy.utils
from comfy_extras.nodes_wan import WanFunControlToVideo, Wan22FunControlToVideo
from safetensors.torch import load_file, save_file
vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(vae_file))
given = load_file(io_file)
conditioning = [[torch.zeros(1, 1, 8), {}]]
positive, _, _ = WanFunControlToVideo.execute(conditioning, conditioning, vae, width, height, length, 1,
                                              start_image=given["image"], control_video=given["control"]).result
positive22, _, _ = Wan22FunControlToVideo.execute(conditioning, conditioning, vae, width, height, length, 1,
                                                  ref_image=given["image"], control_video=given["control"]).result
options, options22 = positive[0][1], positive22[0][1]
save_file({"fun21_latents": options["concat_latent_image"].contiguous(),
           "fun22_latents": options22["concat_latent_image"].contiguous(),
           "fun22_mask": options22["concat_mask"].contiguous(),
           "fun22_mask_index": torch.tensor(options22["concat_mask_index"]),
           "fun22_reference": options22["reference_latents"][-1].contiguous()}, io_file)
vae22 = native_vae22(vae22_file)  # Fun 5B: the tiny Wan 2.2 VAE
positive5b, _, latent5b = Wan22FunControlToVideo.execute(conditioning, conditioning, vae22, width_5b, height, length, 1,
                                                         ref_image=given["image"], control_video=given["control"]).result
options5b = positive5b[0][1]
save_file({**load_file(io_file), "fun5b_latents": options5b["concat_latent_image"].contiguous(),
           "fun5b_mask": options5b["concat_mask"].contiguous(),
           "fun5b_mask_index": torch.tensor(options5b["concat_mask_index"]),
           "fun5b_reference": options5b["reference_latents"][-1].contiguous(),
           "fun5b_latent": latent5b["samples"].contiguous()}, io_file)
"""


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    """A start / reference image and a control video of 6 frames (a folder of images), other sizes and aspects."""
    folder = tmp_path_factory.mktemp("fun_control_media")
    rng = np.random.default_rng(11)
    cv2.imwrite(str(folder / "image.png"), rng.integers(0, 256, (40, 72, 3), dtype=np.uint8))
    (folder / "control").mkdir()
    for index in range(6):
        cv2.imwrite(str(folder / "control" / f"{index:03d}.png"), rng.integers(0, 256, (50, 40, 3), dtype=np.uint8))
    return folder


@pytest.fixture(scope="module")
def native(recent_comfyui_dir: Path, tiny_models_dir: Path, media: Path, tmp_path_factory) -> dict[str, torch.Tensor]:
    io_file = tmp_path_factory.mktemp("native_fun_control") / "io.safetensors"
    save_file({"image": read_image(media / "image.png")[..., :3].contiguous(),
               "control": read_frames(media / "control").contiguous()}, str(io_file))
    done = subprocess.run([sys.executable, "-c", NATIVE, str(tiny_models_dir / TINY_FILES["vae"]), str(io_file),
                           str(WIDTH), str(HEIGHT), str(FRAMES), str(tiny_models_dir / TINY_FILES["vae22"]),
                           str(WIDTH_5B)],
                          cwd=recent_comfyui_dir, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(str(io_file))


@pytest.fixture(scope="module")
def engine_and_vae(tiny_models_dir: Path):
    engine = RankExecutor("cpu")
    return engine, engine.load_vae(str(tiny_models_dir / TINY_FILES["vae"]))


@pytest.fixture(scope="module")
def vae22(engine_and_vae, tiny_models_dir: Path):
    engine, _ = engine_and_vae
    return engine.load_vae(str(tiny_models_dir / TINY_FILES["vae22"]))


def cli_fields(engine_and_vae, media: Path, in_channels: int, vae22=None) -> dict:
    """The SampleRequest fields the command line builds (ImageInputs, the VAE encodes on one in-process rank);
    Fun 5B on the Wan 2.2 VAE ``vae22``."""
    engine, vae = engine_and_vae
    inputs = ImageInputs("fun_control", read_image(media / "image.png"), None, None,
                         read_frames(media / "control"), in_channels)
    width = WIDTH_5B if in_channels == FUN22_5B else WIDTH
    args = SimpleNamespace(width=width, height=HEIGHT, frames=FRAMES, vae_tile=None, vae_overlap=None)
    return inputs.sample_fields(engine, vae if vae22 is None else vae22, args)


def test_wan21_control_video_equals_native_wan_fun_control_to_video(native, engine_and_vae, media) -> None:
    fields = cli_fields(engine_and_vae, media, FUN21)
    assert native["fun21_latents"][:, 16:, :1].std() > 0.05 and native["fun21_latents"][:, :16, :2].std() > 0.05
    assert largest_difference(fields["image_latents"], native["fun21_latents"]) <= TOLERANCE
    assert "image_mask" not in fields and "reference_latent" not in fields


def test_wan22_control_video_equals_native_wan22_fun_control_to_video(native, engine_and_vae, media) -> None:
    fields = cli_fields(engine_and_vae, media, FUN22)
    assert largest_difference(fields["image_latents"], native["fun22_latents"]) <= TOLERANCE
    assert torch.equal(fields["image_mask"], native["fun22_mask"])
    assert fields["image_mask_index"] == int(native["fun22_mask_index"])
    assert native["fun22_reference"].std() > 0.05
    assert largest_difference(fields["reference_latent"], native["fun22_reference"]) <= TOLERANCE


def test_fun_5b_control_video_equals_native_wan22_fun_control_to_video(native, engine_and_vae, vae22, media) -> None:
    fields = cli_fields(engine_and_vae, media, FUN22_5B, vae22)
    assert tuple(native["fun5b_latents"].shape) == (1, 96, 3, HEIGHT // 16, WIDTH_5B // 16)
    assert native["fun5b_latents"][:, :48, :2].std() > 0.05 and native["fun5b_reference"].std() > 0.05
    assert largest_difference(fields["image_latents"], native["fun5b_latents"]) <= TOLERANCE
    assert torch.equal(fields["image_mask"], native["fun5b_mask"])
    assert fields["image_mask_index"] == int(native["fun5b_mask_index"]) == 48
    assert largest_difference(fields["reference_latent"], native["fun5b_reference"]) <= TOLERANCE
    assert torch.equal(fields["latent"], native["fun5b_latent"])


COMMON = ["--prompt", "a fox turns", "--negative", "blurry", "--width", str(WIDTH), "--height", str(HEIGHT),
          "--frames", str(FRAMES), "--steps", str(STEPS), "--seed", str(SEED), "--sampler", "euler", "--device", "cpu"]


def _files(tree: Path, model: str, vae: str = "vae") -> list[str]:
    return ["--model", str(tree / TINY_FILES[model]), "--text-encoder", str(tree / TINY_FILES["text_encoder_native"]),
            "--vae", str(tree / TINY_FILES[vae])]


@pytest.mark.parametrize("model", ["fun22_control", "fun22_5b_control"])
def test_generate_with_a_control_video_samples_the_native_conditioning(tiny_models_dir, media, engine_and_vae, vae22,
                                                                       tmp_path, model: str) -> None:
    five_b = model == "fun22_5b_control"
    latents = tmp_path / "latents.safetensors"
    size = ["--width", str(WIDTH_5B)] if five_b else []
    code = main(["generate", *_files(tiny_models_dir, model, "vae22" if five_b else "vae"), *COMMON, *size,
                 "--out", str(tmp_path / "x.mp4"), "--save-latents", str(latents),
                 "--control-video", str(media / "control"), "--image", str(media / "image.png")])
    assert code == 0
    engine, _ = engine_and_vae
    text = engine.load_text_encoder(str(tiny_models_dir / TINY_FILES["text_encoder_native"]))
    handle = engine.load_model(str(tiny_models_dir / TINY_FILES[model]))
    fields = cli_fields(engine_and_vae, media, FUN22_5B if five_b else FUN22, vae22 if five_b else None)
    latent = fields.pop("latent", torch.zeros(1, 16, 3, HEIGHT // 8, WIDTH // 8))
    request = SampleRequest(handle=handle, latent=latent, positive=engine.encode_text(text, ["a fox turns"]),
                            negative=engine.encode_text(text, ["blurry"]), seed=SEED, steps=STEPS, guidance_scale=5.0,
                            shift=3.0, sampler="euler", **fields)
    saved_latents = load_file(latents)["latents"]
    assert saved_latents.shape[1] == (48 if five_b else 16)
    torch.testing.assert_close(saved_latents, engine.sample(request), rtol=0, atol=1e-5)


class _NoPool:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a worker pool was started for bad input")


@pytest.mark.parametrize("model, flags, message", [
    ("model_native", ["--control-video", "{media}/control"], "--control-video was given but the model is text-to-video"),
    ("i2v", ["--control-video", "{media}/control"], "--control-video was given but the model is Wan 2.1 I2V"),
    ("fun22_control", ["--control-video", "{media}/missing.mp4"], "--control-video {media}/missing.mp4 does not exist"),
    ("fun22_control", ["--image", "{media}/image.png", "--last-image", "{media}/image.png"],
     "the model is Wan Fun Control, which takes a control video and one image; --last-image needs"),
    ("fun22_5b_control", ["--vae", "{vae22}", "--control-video", "{media}/control", "--width", "40"],
     "width 40 is not a positive multiple of 16"),
])
def test_bad_control_video_input_exits_2_with_one_line_before_any_pool(tiny_models_dir, media, tmp_path, monkeypatch,
                                                                       capsys, model, flags, message) -> None:
    monkeypatch.setattr(generate_module, "WorkerPool", _NoPool)
    flags = [flag.format(media=media, vae22=tiny_models_dir / TINY_FILES["vae22"]) for flag in flags]
    code = main(["generate", *_files(tiny_models_dir, model), *COMMON, "--out", str(tmp_path / "x.mp4"), *flags])
    error = capsys.readouterr().err
    assert code == 2
    assert error.startswith("wanmesh: error: ") and error.count("\n") == 1 and "Traceback" not in error
    assert message.format(media=media) in error
