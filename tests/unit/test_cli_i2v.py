"""`wanmesh generate --image [--last-image] [--clip-vision]` end to end on the tiny image-to-video models.

The latents the command saves are compared with a SampleRequest built here from the same pieces, run in this process
(RankExecutor): the image conditioning as native WanImageToVideo / WanFirstLastFrameToVideo build it (resize and
center-crop of an image of another aspect), the video VAE-encoded, the CLIP vision tokens of the tiny encoder; for
Wan 2.2 TI2V the latent and noise mask of native Wan22ImageToVideoLatent on the Wan 2.2 VAE. A
two-rank Ulysses run saves the same latents as one rank; each mistake is exit code 2 and one line before any pool.
"""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from wanmesh.parallel.cli import generate as generate_module
from wanmesh.parallel.cli import main
from wanmesh.parallel.cli.media import read_image
from wanmesh.parallel.image_to_video import first_last_video, start_image_video, wan22_image_latent, wan22_start_frames
from wanmesh.parallel.networks.clip_vision import encode_images
from wanmesh.parallel.weights.clip_vision_files import load_clip_vision
from wanmesh.parallel.protocol import SampleRequest
from wanmesh.parallel.worker.executors import RankExecutor

WIDTH, HEIGHT, FRAMES, STEPS, SEED = 48, 32, 5, 2, 3
COMMON = ["--prompt", "a fox turns", "--negative", "blurry", "--width", str(WIDTH), "--height", str(HEIGHT),
          "--frames", str(FRAMES), "--steps", str(STEPS), "--seed", str(SEED), "--sampler", "euler", "--device", "cpu"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("i2v_images")
    rng = np.random.default_rng(5)
    cv2.imwrite(str(folder / "start.png"), rng.integers(0, 256, (40, 72, 3), dtype=np.uint8))
    cv2.imwrite(str(folder / "end.png"), rng.integers(0, 256, (50, 40, 3), dtype=np.uint8))
    return folder


def _generate(tiny_models_root, out_dir, *flags: str) -> torch.Tensor:
    latents = out_dir / "latents.safetensors"
    code = main(["generate", "--models", str(tiny_models_root), *COMMON, "--out", str(out_dir / "out.mp4"),
                 "--save-latents", str(latents), *flags])
    assert code == 0
    return load_file(latents)["latents"]


def _expected(tiny_models, start, end) -> torch.Tensor:
    """The same run built here: conditioning, encode, CLIP vision tokens and sampling in this process."""
    engine = RankExecutor("cpu")
    build = first_last_video if end is not None else start_image_video
    video, mask = build(start, end, WIDTH, HEIGHT, FRAMES) if end is not None else build(start, WIDTH, HEIGHT, FRAMES)
    vae = engine.load_vae(str(tiny_models["vae"]))
    image_latents = engine.encode(vae, video)
    encoder = load_clip_vision(tiny_models["clip_vision"])
    clip = torch.cat([encode_images(encoder, image[..., :3]).penultimate_hidden_states
                      for image in (start, end) if image is not None], dim=-2)
    text = engine.load_text_encoder(str(tiny_models["text_encoder_native"]))
    positive, negative = engine.encode_text(text, ["a fox turns"]), engine.encode_text(text, ["blurry"])
    model = engine.load_model(str(tiny_models["flf2v" if end is not None else "i2v"]))
    request = SampleRequest(handle=model, latent=torch.zeros(1, 16, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8),
                            positive=positive, negative=negative, seed=SEED, steps=STEPS, guidance_scale=5.0,
                            shift=3.0, sampler="euler", image_latents=image_latents, image_mask=mask, clip_fea=clip)
    return engine.sample(request)


def test_i2v_from_the_command_line_equals_the_same_request_in_process(tiny_models, tiny_models_root, images,
                                                                      tmp_path):
    saved = _generate(tiny_models_root, tmp_path, "--image", str(images / "start.png"))
    expected = _expected(tiny_models, read_image(images / "start.png"), None)
    torch.testing.assert_close(saved, expected, rtol=0, atol=1e-5)


def test_flf2v_on_two_ulysses_ranks_equals_one_rank_and_the_request_in_process(tiny_models, tiny_models_root, images,
                                                                               tmp_path):
    flags = ["--image", str(images / "start.png"), "--last-image", str(images / "end.png")]
    one = _generate(tiny_models_root, tmp_path, *flags)
    (tmp_path / "two").mkdir()
    two = _generate(tiny_models_root, tmp_path / "two", *flags, "--world", "2", "--ulysses", "2")
    torch.testing.assert_close(two, one, rtol=0, atol=1e-4)
    expected = _expected(tiny_models, read_image(images / "start.png"), read_image(images / "end.png"))
    torch.testing.assert_close(one, expected, rtol=0, atol=1e-5)


def test_ti2v_from_the_command_line_keeps_the_start_image_latents_as_native(tiny_models, images, tmp_path):
    files = ["--model", str(tiny_models["ti2v"]), "--vae", str(tiny_models["vae22"]), "--text-encoder",
             str(tiny_models["text_encoder_native"])]
    latents = tmp_path / "latents.safetensors"
    size = ["--width", "64", "--height", "48", "--frames", "9", "--steps", "2", "--seed", str(SEED), "--sampler",
            "euler", "--shift", "3", "--cfg", "5", "--device", "cpu", "--prompt", "a fox turns", "--negative", "blurry"]
    assert main(["generate", *files, *size, "--image", str(images / "start.png"), "--out", str(tmp_path / "o.mp4"),
                 "--save-latents", str(latents)]) == 0
    engine = RankExecutor("cpu")
    vae = engine.load_vae(str(tiny_models["vae22"]))
    latent = wan22_image_latent(engine.encode(vae, wan22_start_frames(read_image(images / "start.png"), 64, 48, 9)),
                                64, 48, 9, 1)
    text = engine.load_text_encoder(str(tiny_models["text_encoder_native"]))
    request = SampleRequest(handle=engine.load_model(str(tiny_models["ti2v"])), latent=latent["samples"],
                            noise_mask=latent["noise_mask"], positive=engine.encode_text(text, ["a fox turns"]),
                            negative=engine.encode_text(text, ["blurry"]), seed=SEED, steps=2, guidance_scale=5.0,
                            shift=3.0, sampler="euler")
    saved = load_file(latents)["latents"]
    torch.testing.assert_close(saved, engine.sample(request), rtol=0, atol=1e-5)
    # the first latent frame is the start image's, kept through sampling
    torch.testing.assert_close(saved[:, :, :1], latent["samples"][:, :, :1], rtol=0, atol=1e-5)


class _NoPool:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a worker pool was started for bad input")


@pytest.mark.parametrize("model, flags, message", [
    ("t2v", ["--image", "{images}/start.png"], "--image/--last-image were given but the model is text-to-video"),
    ("i2v_high", ["--image", "{images}/start.png", "--last-image", "{images}/end.png"],
     "the model is Wan 2.2 I2V A14B, which takes one image; --last-image needs a first-last-frame (FLF2V) model"),
    ("i2v_high", [], "the model is Wan 2.2 I2V A14B: give the start image with --image"),
    ("i2v_high", ["--image", "{images}/missing.png"], "--image {images}/missing.png does not exist"),
    ("ti2v", ["--image", "{images}/start.png", "--width", "72"], "width 72 is not a positive multiple of 16"),
    ("ti2v", ["--vae", "{vae}"], "is the Wan 2.1 VAE (wan_2.1_vae.safetensors), but --model"),
    ("model_native", ["--vae", "{vae22}"], "is the Wan 2.2 VAE (wan2.2_vae.safetensors), but --model"),
    ("fun_control", ["--image", "{images}/start.png", "--last-image", "{images}/end.png"],
     "the model is Wan Fun Control, which takes a control video and one image"),
])
def test_bad_image_input_exits_2_with_one_line_before_any_pool(tiny_models, images, tmp_path, monkeypatch, capsys,
                                                                model, flags, message):
    monkeypatch.setattr(generate_module, "WorkerPool", _NoPool)
    text_encoder = tiny_models["text_encoder" if model == "t2v" else "text_encoder_native"]
    vae = tiny_models["vae22" if model == "ti2v" else "vae"]
    names = {"images": images, "vae": tiny_models["vae"], "vae22": tiny_models["vae22"]}
    flags = [flag.format(**names) for flag in flags]
    files = ["--model", str(tiny_models[model]), "--text-encoder", str(text_encoder)]
    files += [] if "--vae" in flags else ["--vae", str(vae)]
    code = main(["generate", *files, *COMMON, "--out", str(tmp_path / "x.mp4"), *flags])
    error = capsys.readouterr().err
    assert code == 2
    assert error.startswith("wanmesh: error: ") and error.count("\n") == 1 and "Traceback" not in error
    assert message.format(**names) in error


@pytest.mark.parametrize("kind, name, last_image", [("clip_vision", "Wan 2.1 I2V", None),
                                                    ("first_last", "Wan 2.1 FLF2V", "end.png")])
def test_no_clip_vision_file_samples_as_native_without_its_tokens_and_says_so_once(capsys, kind, name, last_image):
    from types import SimpleNamespace

    from wanmesh.parallel.cli.image_inputs import check_image_arguments

    check_image_arguments(kind, SimpleNamespace(image="start.png", last_image=last_image), None)
    assert capsys.readouterr().err.splitlines() == [
        f"wanmesh: the model is {name} and no --clip-vision was given: sampling without CLIP vision tokens, as "
        "ComfyUI's WanImageToVideo / WanFirstLastFrameToVideo do without a CLIP vision output"]
    check_image_arguments(kind, SimpleNamespace(image="start.png", last_image=last_image), "clip_vision_h.safetensors")
    assert capsys.readouterr().err == ""
