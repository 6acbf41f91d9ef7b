"""WanMesh's CLIP vision encoder beside the recent ComfyUI's own (``comfy.clip_vision``) on the tiny CLIP vision file.

The native side runs in a subprocess inside the recent ComfyUI copy: ``ClipVisionModel`` built from the tiny model's
config.json (ComfyUI's ``CLIPVisionLoader`` picks its config by layer count and knows only released sizes), the
file's tensors through ``load_sd`` (the OpenCLIP copy first through ``convert_to_transformers``, as ComfyUI's
``load`` converts ``visual.*`` files), then ``encode_image`` and ``clip_preprocess``. WanMesh's side is
``load_clip_vision`` / ``encode_images`` in this process. Both get the same two 96x160 images, encoded with the centre
crop and squeezed (no crop):

* the pixels after preprocessing are ComfyUI's (1e-6);
* last_hidden_state, image_embeds and penultimate_hidden_states equal ComfyUI's in float32 (1e-4), for both key
  layouts;
* the WanMesh CLIP Vision Encode node, run inside ComfyUI, returns ComfyUI's own ``comfy.clip_vision.Output`` with
  native's values, so native WanImageToVideo takes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from native_scripts import run_in_comfyui

IMAGES_SHAPE = (2, 96, 160, 3)  # not 224x224: resized and cropped (or squeezed) first
FIELDS = ("last_hidden_state", "image_embeds", "penultimate_hidden_states")
LAYOUTS = ("transformers", "openclip")
CROPS = {"center": True, "none": False}
TOLERANCE = 1e-4
PIXEL_TOLERANCE = 1e-6

NATIVE = r"""
import sys
config_file, clip_file, openclip_file, io_file = sys.argv[1:5]
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import comfy.clip_vision, comfy.utils
from safetensors.torch import load_file, save_file
from wanmesh.nodes.clip_vision import WanMeshCLIPVisionEncode
from wanmesh.parallel.weights.clip_vision_files import load_clip_vision
FIELDS = ("last_hidden_state", "image_embeds", "penultimate_hidden_states")

def native(state):
    model = comfy.clip_vision.ClipVisionModel(config_file)
    missing, unexpected = model.load_sd(state)
    assert not missing and not unexpected, (missing, unexpected)
    return model

models = {"transformers": native(comfy.utils.load_torch_file(clip_file)),
          "openclip": native(comfy.clip_vision.convert_to_transformers(comfy.utils.load_torch_file(openclip_file),
                                                                       "visual."))}
images = load_file(io_file)["images"]
out = {}
for crop_name, crop in (("center", True), ("none", False)):
    out[f"pixels.{crop_name}"] = comfy.clip_vision.clip_preprocess(images, crop=crop).contiguous()
    for layout, model in models.items():
        encoded = model.encode_image(images, crop=crop)
        out.update({f"{layout}.{crop_name}.{name}": encoded[name].float().contiguous() for name in FIELDS})
(node_output,) = WanMeshCLIPVisionEncode().encode(load_clip_vision(clip_file), images, "center")
assert type(node_output) is comfy.clip_vision.Output, type(node_output)
out.update({f"node.{name}": getattr(node_output, name).contiguous() for name in FIELDS})
save_file(out, io_file)
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    from wanmesh.parallel.tiny.clip_vision import (CLIP_VISION_FILE, TINY_CLIP_VISION_COMFY, openclip_state,
                                                   tiny_clip_vision_state, write_tiny_clip_vision)

    root = tmp_path_factory.mktemp("native_clip_vision")
    config = root / "config.json"
    config.write_text(json.dumps(TINY_CLIP_VISION_COMFY))
    openclip = root / "clip_vision_openclip.safetensors"
    save_file(openclip_state(tiny_clip_vision_state()), str(openclip))
    return {"config": config, "transformers": write_tiny_clip_vision(root / CLIP_VISION_FILE), "openclip": openclip,
            "io": root / "io.safetensors"}


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.rand(*IMAGES_SHAPE, generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def native(recent_comfyui_dir: Path, files, images) -> dict[str, torch.Tensor]:
    save_file({"images": images}, str(files["io"]))
    run_in_comfyui(NATIVE, recent_comfyui_dir, *(files[name] for name in ("config", "transformers", "openclip", "io")),
                   timeout_s=300)
    return load_file(str(files["io"]))


@pytest.fixture(scope="module")
def wanmesh(files, images) -> dict[str, torch.Tensor]:
    from wanmesh.parallel.networks.clip_vision import encode_images
    from wanmesh.parallel.weights.clip_vision_files import load_clip_vision

    out = {}
    for layout in LAYOUTS:
        model = load_clip_vision(files[layout])
        for crop_name, crop in CROPS.items():
            encoded = encode_images(model, images, crop=crop)
            out.update({f"{layout}.{crop_name}.{name}": encoded[name] for name in FIELDS})
    return out


def _largest(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max())


@pytest.mark.parametrize("crop", list(CROPS))
def test_preprocessing_equals_comfyuis_clip_preprocess(native, images, crop) -> None:
    from wanmesh.parallel.networks.clip_vision import clip_preprocess

    assert _largest(clip_preprocess(images, crop=CROPS[crop]), native[f"pixels.{crop}"]) <= PIXEL_TOLERANCE


@pytest.mark.parametrize("crop", list(CROPS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_outputs_equal_comfyuis_encode_image(native, wanmesh, layout, crop) -> None:
    key = f"{layout}.{crop}"
    assert native[f"{key}.penultimate_hidden_states"].shape == (IMAGES_SHAPE[0], 257, 1280)
    assert float(native[f"{key}.penultimate_hidden_states"].std()) > 0.1  # the tokens are not flat
    for name in FIELDS:
        assert _largest(wanmesh[f"{key}.{name}"], native[f"{key}.{name}"]) <= TOLERANCE, name


def test_the_encode_node_gives_comfyuis_output_type_with_natives_values(native) -> None:
    # the subprocess asserted the type (comfy.clip_vision.Output); here its values
    for name in FIELDS:
        assert _largest(native[f"node.{name}"], native[f"transformers.center.{name}"]) <= TOLERANCE, name
