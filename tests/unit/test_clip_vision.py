"""The CLIP vision encoder (Wan 2.1 image-to-video's image tokens): the tiny file loads with its config inferred
from shapes, gives ViT-H's token shapes and the in-memory model's outputs, both key layouts (transformers and
OpenCLIP) load to the same model, preprocessing follows ComfyUI's clip_preprocess, other files are refused in one
line, and the two nodes load and encode (ComfyUI's folder list stubbed). Parity with ComfyUI's own encoder is in
tests/comfyui/test_native_clip_vision.py."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from safetensors.torch import save_file

from wanmesh.parallel.weights.checkpoint import ModelFileError
from wanmesh.parallel.networks.clip_vision import CLIP_MEAN, CLIP_STD, ClipVisionOutput, clip_preprocess, encode_images
from wanmesh.parallel.weights.clip_vision_files import clip_head_count, infer_clip_vision_config, load_clip_vision
from wanmesh.parallel.tiny.clip_vision import (CLIP_VISION_FILE, TINY_CLIP_VISION, build_tiny_clip_vision,
                                               openclip_state, tiny_clip_vision_state, write_tiny_clip_vision)

TOKENS, WIDTH = 257, 1280  # ViT-H/14 at 224 px: a class token and 16 x 16 patches, 1280 wide


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("clip_vision")
    state = tiny_clip_vision_state()
    openclip = root / "clip_vision_openclip.safetensors"
    save_file(openclip_state(state), str(openclip))
    text_tower = {"text_model.embeddings.token_embedding.weight": torch.zeros(8, 4), "logit_scale": torch.ones(())}
    full_clip = root / "clip_full.safetensors"
    save_file({**state, **text_tower}, str(full_clip))
    return {"transformers": write_tiny_clip_vision(root / CLIP_VISION_FILE), "openclip": openclip,
            "full_clip": full_clip, "root": root}


@pytest.fixture(scope="module")
def model(files):
    return load_clip_vision(files["transformers"])


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.rand(2, 96, 160, 3, generator=torch.Generator().manual_seed(3))


def test_the_tiny_file_loads_with_vit_h_width_heads_and_image_size(files, model):
    assert files["transformers"].relative_to(files["root"]).as_posix() == "clip_vision/clip_vision_tiny.safetensors"
    config = model.config
    heads = config.num_attention_heads
    assert (config.hidden_size, heads, config.hidden_size // heads) == (1280, 16, 80)
    assert (config.num_hidden_layers, config.intermediate_size, config.image_size, config.patch_size) == \
        (2, 512, 224, 14)
    assert (config.hidden_act, config.layer_norm_eps, config.projection_dim) == ("gelu", 1e-5, 64)
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_encoding_gives_comfyui_output_fields_with_vit_h_token_shapes(model, images):
    out = encode_images(model, images)
    assert isinstance(out, ClipVisionOutput)
    assert out.penultimate_hidden_states.shape == out.last_hidden_state.shape == (2, TOKENS, WIDTH)
    assert out.image_embeds.shape == (2, TINY_CLIP_VISION["projection_dim"]) and out["mm_projected"] is None
    assert out["penultimate_hidden_states"] is out.penultimate_hidden_states  # item access, as ComfyUI's Output
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for _, v in out.items() if v is not None)
    assert float(out.penultimate_hidden_states.std()) > 0.1
    assert not torch.equal(out.penultimate_hidden_states, out.last_hidden_state)


def test_outputs_equal_the_in_memory_model(model, images):
    reference = build_tiny_clip_vision()
    pixels = clip_preprocess(images, 224)
    with torch.no_grad():
        expected = reference(pixel_values=pixels, output_hidden_states=True)
    out = encode_images(model, images)
    # transformers' hidden_states: the embeddings, then each layer's output; [-2] is the next-to-last layer's
    assert torch.allclose(out.penultimate_hidden_states, expected.hidden_states[-2], atol=1e-5)
    assert torch.allclose(out.last_hidden_state, expected.last_hidden_state, atol=1e-5)
    assert torch.allclose(out.image_embeds, expected.image_embeds, atol=1e-5)


def test_openclip_and_full_clip_files_give_the_same_outputs(files, model, images):
    expected = encode_images(model, images)
    for layout in ("openclip", "full_clip"):
        out = encode_images(load_clip_vision(files[layout]), images)
        for name, value in expected.items():
            if value is not None:
                assert torch.equal(out[name], value), (layout, name)


def test_bfloat16_weights_stay_close(files, model, images):
    expected = encode_images(model, images).penultimate_hidden_states
    low = encode_images(load_clip_vision(files["transformers"], torch.bfloat16), images).penultimate_hidden_states
    assert low.dtype == torch.float32 and float((low - expected).abs().max()) < 0.1 * float(expected.abs().max())


# -- preprocessing ------------------------------------------------------------------------------------------------

def _normalised(rgb: torch.Tensor) -> torch.Tensor:
    levels = torch.clip(255.0 * rgb, 0, 255).round() / 255.0
    return (levels - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)


def test_a_224_image_is_only_rounded_to_8_bit_and_normalised():
    image = torch.rand(1, 224, 224, 3, generator=torch.Generator().manual_seed(1))
    expected = _normalised(image).movedim(-1, 1)
    assert torch.allclose(clip_preprocess(image), expected, atol=1e-6)
    with_alpha = torch.cat([image, torch.zeros(1, 224, 224, 1)], dim=-1)
    assert torch.equal(clip_preprocess(with_alpha), clip_preprocess(image))  # the alpha channel is dropped


def test_resizing_is_bicubic_antialiased_short_side_then_centre_crop(images):
    scaled = torch.nn.functional.interpolate(images.movedim(-1, 1), size=(224, 373), mode="bicubic", antialias=True)
    expected = _normalised(scaled[:, :, :, 74:298].movedim(1, -1)).movedim(-1, 1)  # (373 - 224) // 2 = 74
    assert torch.allclose(clip_preprocess(images), expected, atol=1e-6)
    squeezed = torch.nn.functional.interpolate(images.movedim(-1, 1), size=(224, 224), mode="bicubic", antialias=True)
    assert torch.allclose(clip_preprocess(images, crop=False), _normalised(squeezed.movedim(1, -1)).movedim(-1, 1),
                          atol=1e-6)


def test_centre_crop_cuts_the_sides_and_no_crop_keeps_them():
    image = torch.full((1, 96, 160, 3), 0.4)  # 102 of 255: far from a rounding edge
    image[:, :, :20] = torch.tensor([1.0, 0.0, 0.0])  # a red band on the left, a blue one on the right
    image[:, :, -20:] = torch.tensor([0.0, 0.0, 1.0])
    grey = _normalised(torch.full((3,), 0.4))
    cropped, squeezed = clip_preprocess(image), clip_preprocess(image, crop=False)
    assert torch.allclose(cropped[0, :, :, 0], grey[:, None].expand(3, 224), atol=1e-6)
    assert torch.allclose(cropped[0, :, :, -1], grey[:, None].expand(3, 224), atol=1e-6)
    assert squeezed[0, 0, 100, 0] > 1.5 and squeezed[0, 2, 100, -1] > 1.5  # red left, blue right


@pytest.mark.parametrize("bad", [torch.rand(96, 160, 3), torch.rand(1, 96, 160, 2), torch.rand(0, 96, 160, 3)])
def test_images_that_are_not_a_comfyui_image_are_refused(bad):
    with pytest.raises(ValueError, match=r"IMAGE \[count, height, width, 3") as error:
        clip_preprocess(bad)
    assert "\n" not in str(error.value)


# -- config rules and refusals --------------------------------------------------------------------------------------

def test_head_count_rule_and_metadata():
    assert [clip_head_count(width) for width in (768, 1024, 1280, 1664)] == [12, 16, 16, 16]
    assert clip_head_count(1280, {"num_heads": "20"}) == 20
    with pytest.raises(ModelFileError, match="do not divide the width 1280"):
        clip_head_count(1280, {"num_heads": "7"})


def test_activation_follows_comfyuis_configs_unless_the_metadata_names_one():
    def shapes(width, layers):
        found = {"vision_model.embeddings.class_embedding": (width,),
                 "vision_model.embeddings.patch_embedding.weight": (width, 3, 14, 14),
                 "vision_model.embeddings.position_embedding.weight": (257, width)}
        return found | {f"vision_model.encoder.layers.{i}.mlp.fc1.weight": (4 * width, width) for i in range(layers)}

    assert infer_clip_vision_config(shapes(1024, 24))["hidden_act"] == "quick_gelu"  # OpenAI ViT-L/14
    assert infer_clip_vision_config(shapes(1280, 32))["hidden_act"] == "gelu"  # OpenCLIP ViT-H/14
    assert infer_clip_vision_config(shapes(1280, 32), {"hidden_act": "quick_gelu"})["hidden_act"] == "quick_gelu"
    odd = shapes(1280, 2) | {"vision_model.embeddings.position_embedding.weight": (200, 1280)}
    with pytest.raises(ModelFileError, match="200 position embeddings are not a class token plus a square grid"):
        infer_clip_vision_config(odd)


def _refusal(path) -> str:
    with pytest.raises(ModelFileError) as error:
        load_clip_vision(path)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_other_files_are_refused_in_one_line(tmp_path):
    wan = tmp_path / "wan_t2v.safetensors"
    save_file({"patch_embedding.weight": torch.zeros(8, 16, 1, 2, 2), "blocks.0.self_attn.q.weight": torch.zeros(8, 8)},
              str(wan))
    message = _refusal(wan)
    assert "expected a CLIP vision encoder" in message and "Wan text-to-video transformer" in message
    i2v = tmp_path / "wan_i2v.safetensors"
    save_file({"patch_embedding.weight": torch.zeros(8, 36, 1, 2, 2), "img_emb.proj.0.weight": torch.zeros(8)},
              str(i2v))
    assert "Wan image-to-video transformer" in _refusal(i2v)
    garbage = tmp_path / "random.safetensors"
    garbage.write_bytes(torch.randint(0, 255, (4096,), generator=torch.Generator().manual_seed(0),
                                      dtype=torch.uint8).numpy().tobytes())
    assert "not a valid safetensors file" in _refusal(garbage)
    assert "a folder" in _refusal(tmp_path)


def test_siglip_and_truncated_encoders_are_refused(tmp_path):
    state = tiny_clip_vision_state()
    siglip = tmp_path / "siglip.safetensors"
    save_file({k: v for k, v in state.items() if "class_embedding" not in k}, str(siglip))
    assert "SigLIP" in _refusal(siglip)
    missing = tmp_path / "missing.safetensors"
    save_file({k: v for k, v in state.items() if "layers.1.mlp.fc2" not in k}, str(missing))
    assert "missing 2 tensors: vision_model.encoder.layers.1.mlp.fc2.bias" in _refusal(missing)


def test_a_file_without_projection_gives_the_class_token_as_image_embeds(tmp_path, model, images):
    path = tmp_path / "no_projection.safetensors"
    save_file({k: v for k, v in tiny_clip_vision_state().items() if k != "visual_projection.weight"}, str(path))
    out = encode_images(load_clip_vision(path), images)
    expected = encode_images(model, images)
    assert out.image_embeds.shape == (2, WIDTH)
    assert torch.allclose(out.image_embeds, model.vision_model.post_layernorm(expected.last_hidden_state[:, 0]),
                          atol=1e-5)


# -- nodes ----------------------------------------------------------------------------------------------------------

@pytest.fixture()
def folder(files, monkeypatch):
    stub = types.ModuleType("folder_paths")
    clip_folder = files["transformers"].parent
    stub.folder_names_and_paths = {"clip_vision": ([str(clip_folder)], {".safetensors"})}
    stub.get_filename_list = lambda name: sorted(p.name for p in clip_folder.iterdir())
    stub.get_full_path = lambda name, file: str(clip_folder / file) if (clip_folder / file).is_file() else None
    monkeypatch.setitem(sys.modules, "folder_paths", stub)
    return clip_folder


def test_nodes_load_and_encode_without_comfyui(folder, model, images):
    from wanmesh.nodes.clip_vision import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    loader, encoder = NODE_CLASS_MAPPINGS["WanMeshCLIPVisionLoader"], NODE_CLASS_MAPPINGS["WanMeshCLIPVisionEncode"]
    assert NODE_DISPLAY_NAME_MAPPINGS == {"WanMeshCLIPVisionLoader": "WanMesh CLIP Vision Loader",
                                         "WanMeshCLIPVisionEncode": "WanMesh CLIP Vision Encode"}
    assert loader.INPUT_TYPES()["required"]["clip_name"][0] == ["clip_vision_tiny.safetensors"]
    assert encoder.INPUT_TYPES()["required"]["crop"][0] == ["center", "none"]
    assert encoder.RETURN_TYPES == ("CLIP_VISION_OUTPUT",) and loader.RETURN_TYPES == ("WANMESH_CLIP_VISION",)
    (clip_vision,) = loader().load("clip_vision_tiny.safetensors")
    (cropped,) = encoder().encode(clip_vision, images, "center")
    (squeezed,) = encoder().encode(clip_vision, images, "none")
    assert torch.equal(cropped.penultimate_hidden_states, encode_images(model, images).penultimate_hidden_states)
    assert torch.equal(squeezed.penultimate_hidden_states,
                       encode_images(model, images, crop=False).penultimate_hidden_states)
    assert next(clip_vision.parameters()).device.type == "cpu"


def test_the_loader_names_a_missing_or_wrong_file(folder, tmp_path):
    from wanmesh.nodes.clip_vision import WanMeshCLIPVisionLoader

    with pytest.raises(FileNotFoundError, match="clip_name 'gone.safetensors' was not found"):
        WanMeshCLIPVisionLoader().load("gone.safetensors")
    wrong = folder / "umt5.safetensors"
    save_file({"encoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(4, 4)}, str(wrong))
    try:
        with pytest.raises(ModelFileError, match="expected a CLIP vision encoder.*umT5 text encoder"):
            WanMeshCLIPVisionLoader().load("umt5.safetensors")
    finally:
        wrong.unlink()
