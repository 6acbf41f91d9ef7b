"""Wan Fun Camera: the file is told from its tensors (the camera adapter, as ComfyUI's model detection tells
it; Wan 2.2's layout by its 36 input channels), its safetensors, scaled-fp8 and GGUF kinds load with the adapter,
the camera embedding reaches the tokens, and bad inputs are one line: a Fun Camera layout of another width, a camera embedding of another length or size, camera
conditions for a model without an adapter, ``--image`` for a camera model on the command line. (Parity with
native ComfyUI, the parallel layouts and the example workflow: tests/comfyui/test_fun_camera.py.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file

from wanmesh.parallel.cli import generate as generate_module
from wanmesh.parallel.cli import main
from wanmesh.parallel.config import check_camera_conditions
from wanmesh.parallel.sampling.forward import camera_inputs
from wanmesh.parallel.tiny.fp8_write import write_fp8_file
from wanmesh.parallel.tiny.gguf_write import write_wan_gguf
from wanmesh.parallel.validation import model_image_inputs
from wanmesh.parallel.weights.checkpoint import ModelFileError
from wanmesh.parallel.weights.detect import detect_kind, image_inputs, infer_transformer_config, read_header
from wanmesh.parallel.weights.loaders import load_transformer

LATENT = (1, 16, 3, 4, 6)  # 9 frames of 48 x 32
CAMERA = (1, 24, 3, 32, 48)


@pytest.fixture(scope="module")
def camera_files(tiny_models, tmp_path_factory) -> dict[str, str]:
    """The tiny Fun Camera file and its scaled-fp8 and Q8_0 GGUF twins."""
    folder = tmp_path_factory.mktemp("fun_camera")
    state = load_file(str(tiny_models["fun_camera"]))
    metadata = read_header(tiny_models["fun_camera"]).metadata
    write_fp8_file(state, folder / "camera_fp8_scaled.safetensors", torch.float8_e4m3fn, scaled=True,
                   metadata=metadata)
    write_wan_gguf(state, folder / "camera_Q8_0.gguf", GGMLQuantizationType.Q8_0,
                   num_heads=int(metadata["num_heads"]))
    return {"safetensors": str(tiny_models["fun_camera"]), "fp8_scaled": str(folder / "camera_fp8_scaled.safetensors"),
            "gguf_q8_0": str(folder / "camera_Q8_0.gguf")}


def _call(model, camera: torch.Tensor | None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    latent = torch.randn(1, 32, *LATENT[2:], generator=generator)
    text = torch.randn(1, 512, 4096, generator=generator)
    extra = {} if camera is None else {"camera_conditions": camera}
    with torch.no_grad():
        return model(hidden_states=latent, timestep=torch.tensor([700.0]), encoder_hidden_states=text,
                     return_dict=False, **extra)[0]


def _camera() -> torch.Tensor:
    return torch.randn(CAMERA, generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("kind", ["safetensors", "fp8_scaled", "gguf_q8_0"])
def test_every_file_kind_is_recognised_as_fun_camera(camera_files, kind: str) -> None:
    header = read_header(camera_files[kind])
    assert detect_kind(header.shapes) == "wan_i2v"  # a Wan transformer with image tokens, not a refused family
    config = infer_transformer_config(header.shapes, header.metadata)
    assert config["camera_in_channels"] == 24 and config["in_channels"] == 32
    assert model_image_inputs(camera_files[kind]) == (32, "camera")


@pytest.mark.parametrize("kind", ["fp8_scaled", "gguf_q8_0"])
def test_quantized_kinds_load_the_adapter_and_take_the_camera(camera_files, kind: str) -> None:
    reference = load_transformer(camera_files["safetensors"])
    model = load_transformer(camera_files[kind])
    assert type(model).__name__ == "WanCameraTransformer3DModel"
    for name, parameter in reference.control_adapter.state_dict().items():
        torch.testing.assert_close(model.control_adapter.state_dict()[name], parameter, rtol=1e-3, atol=1e-3)
    with_camera, without = _call(model, _camera()), _call(model, None)
    quantisation_error = (with_camera - _call(reference, _camera())).abs().max().item()
    camera_effect = (with_camera - without).abs().max().item()
    assert quantisation_error < 0.1 and camera_effect > 10 * quantisation_error, (quantisation_error, camera_effect)


def test_one_camera_row_serves_every_latent_row(camera_files) -> None:
    model = load_transformer(camera_files["safetensors"])
    generator = torch.Generator().manual_seed(5)
    latent, text = torch.randn(2, 32, *LATENT[2:], generator=generator), torch.randn(2, 512, 4096, generator=generator)
    camera = _camera()
    with torch.no_grad():
        one = model(hidden_states=latent, timestep=torch.tensor([700.0, 700.0]), encoder_hidden_states=text,
                    return_dict=False, camera_conditions=camera)[0]
        both = model(hidden_states=latent, timestep=torch.tensor([700.0, 700.0]), encoder_hidden_states=text,
                     return_dict=False, camera_conditions=camera.expand(2, -1, -1, -1, -1))[0]
    torch.testing.assert_close(one, both, rtol=0, atol=0)


def _camera_shapes(camera_files, in_channels: int) -> dict:
    """The tiny Fun Camera file's shapes without its image embedding, with ``in_channels`` input channels."""
    shapes = {key: shape for key, shape in read_header(camera_files["safetensors"]).shapes.items()
              if not key.startswith("img_emb.") and "_img" not in key}
    dim, _, *patch = shapes["patch_embedding.weight"]
    shapes["patch_embedding.weight"] = (dim, in_channels, *patch)
    return shapes


def test_the_wan22_fun_camera_layout_is_read_as_a_camera_model(camera_files) -> None:
    config = infer_transformer_config(_camera_shapes(camera_files, 36), {"num_heads": "2"})
    assert (config["in_channels"], config["camera_in_channels"], config.get("image_dim")) == (36, 24, None)
    assert image_inputs(config) == "camera"


def test_another_fun_camera_width_is_refused_in_one_line(camera_files) -> None:
    with pytest.raises(ModelFileError, match=r"takes 40 input channels, which is not supported; supported: Wan 2.1 "
                                             r"Fun Camera \(32 input channels\) and Wan 2.2 Fun Camera \(36\)") as error:
        infer_transformer_config(_camera_shapes(camera_files, 40), {"num_heads": "2"})
    assert "\n" not in str(error.value) and len(str(error.value)) <= 300


@pytest.mark.parametrize("shape, expected", [
    ((1, 24, 4, 32, 48), "expected [1 or 1, channels, 3, 32, 48]"),  # another length
    ((1, 24, 3, 64, 96), "expected [1 or 1, channels, 3, 32, 48]"),  # another size
    ((2, 24, 3, 32, 48), "expected [1 or 1, channels, 3, 32, 48]"),  # more rows than the latent
    ((24, 3, 32, 48), "expected [1 or 1, channels, 3, 32, 48]"),
])
def test_a_camera_embedding_for_another_video_is_one_line(shape, expected) -> None:
    with pytest.raises(ValueError) as error:
        check_camera_conditions(torch.zeros(shape), LATENT)
    message = str(error.value)
    assert expected in message and "WanCameraEmbedding" in message and "\n" not in message and len(message) <= 300
    check_camera_conditions(torch.zeros(CAMERA), LATENT)  # the right one passes


def test_camera_conditions_for_a_model_without_an_adapter_are_refused(tiny_models) -> None:
    model = load_transformer(str(tiny_models["i2v"]))
    with pytest.raises(ValueError, match="carries camera_conditions .* has no camera adapter"):
        camera_inputs(model, _camera(), range(1), 1, torch.float32, "cpu")
    assert camera_inputs(model, None, range(1), 1, torch.float32, "cpu") == {}


def test_adapter_of_another_width_is_named(camera_files) -> None:
    model = load_transformer(camera_files["safetensors"])
    with pytest.raises(ValueError, match="camera_conditions has 12 channels; this Fun Camera model takes 24"):
        _call(model, torch.zeros(1, 12, 3, 32, 48))


class _NoPool:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a pool was started for a refused command")


CLI_SIZE = ["--width", "48", "--height", "32", "--frames", "9", "--steps", "2", "--seed", "3", "--sampler", "euler",
            "--shift", "3", "--cfg", "5", "--device", "cpu", "--prompt", "a fox turns", "--negative", "blurry"]


def _camera_cli(tiny_models, model: str = "fun_camera") -> list[str]:
    return ["generate", "--model", str(tiny_models[model]), "--vae", str(tiny_models["vae"]),
            "--text-encoder", str(tiny_models["text_encoder_native"]), *CLI_SIZE]


@pytest.mark.parametrize("model, flags, message", [
    ("fun_camera", ["--image", "{image}"], "the model is Wan Fun Camera; the command line runs it without a start "
                                           "image (--camera-motion only)"),
    ("fun_camera", ["--camera-motion", "pan-left", "--camera-speed", "11"], "--camera-speed 11.0 is outside 0..10"),
    ("fun_camera", ["--camera-motion", "pan-left", "--width", "40"], "width 40 is not a positive multiple of 16"),
    ("fun22_camera", ["--image", "{image}"], "the model is Wan Fun Camera; the command line runs it without a start "
                                             "image (--camera-motion only)"),
    ("i2v", ["--camera-motion", "zoom-in", "--image", "{image}"], "--camera-motion needs a Wan Fun Camera model"),
])
def test_bad_camera_input_on_the_command_line_is_one_line(tiny_models, tmp_path, monkeypatch, capsys, model, flags,
                                                          message) -> None:
    import cv2
    import numpy as np

    monkeypatch.setattr(generate_module, "WorkerPool", _NoPool)
    image = tmp_path / "start.png"
    cv2.imwrite(str(image), np.full((32, 48, 3), 128, dtype=np.uint8))
    flags = [flag.format(image=image) for flag in flags]
    code = main([*_camera_cli(tiny_models, model), *flags, "--out", str(tmp_path / "x.mp4")])
    error = capsys.readouterr().err
    assert code == 2 and error.startswith("wanmesh: error: ") and error.count("\n") == 1, error
    assert message in error


@pytest.mark.parametrize("model", ["fun_camera", "fun22_camera"])
def test_camera_motion_on_the_command_line_equals_the_request_in_process(tiny_models, tmp_path, model) -> None:
    """``--camera-motion`` sends WanCameraEmbedding's embedding (tests/comfyui/test_camera_motion.py checks it
    against the node) with the request, for the Wan 2.1 and the Wan 2.2 Fun Camera file: the saved latents are the
    in-process run's, and the camera changes them."""
    from wanmesh.parallel.camera_motion import camera_embedding
    from wanmesh.parallel.protocol import SampleRequest
    from wanmesh.parallel.worker.executors import RankExecutor

    latents = tmp_path / "latents.safetensors"
    assert main([*_camera_cli(tiny_models, model), "--camera-motion", "pan-left", "--camera-speed", "1.5",
                 "--out", str(tmp_path / "camera.mp4"), "--save-latents", str(latents)]) == 0
    saved = load_file(str(latents))["latents"]
    engine = RankExecutor("cpu")
    text = engine.load_text_encoder(str(tiny_models["text_encoder_native"]))
    request = SampleRequest(handle=engine.load_model(str(tiny_models[model])), latent=torch.zeros(LATENT),
                            positive=engine.encode_text(text, ["a fox turns"]), negative=engine.encode_text(text, ["blurry"]),
                            seed=3, steps=2, guidance_scale=5.0, shift=3.0, sampler="euler",
                            camera_conditions=camera_embedding("pan-left", 48, 32, 9, 1.5))
    torch.testing.assert_close(saved, engine.sample(request), rtol=0, atol=1e-5)
    without_camera = engine.sample(replace(request, camera_conditions=None))
    assert (saved - without_camera).abs().max().item() > 1e-2
