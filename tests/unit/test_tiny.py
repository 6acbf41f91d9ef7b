"""The tiny model tree: layouts, determinism, and agreement with the in-memory models and diffusers."""

from __future__ import annotations

import json

import pytest
import sentencepiece
import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel, WanVACETransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers, convert_wan_vae_to_diffusers
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import UMT5EncoderModel

from wanmesh.parallel.tiny import models as tiny

EXPECTED_KEYS = {"t2v", "vace", "vae", "text_encoder", "vace_module", "diffusers_t2v", "diffusers_vace",
                 "t2v_gguf_q8_0", "t2v_gguf_q4_k",
                 "lora_comfy", "lora_peft", "lora_kohya", "lora_diff", "t2v_low"}
WAN_LATENTS_MEAN_FIRST = -0.7571
WAN_LATENTS_STD_FIRST = 2.8184


def assert_same_state(loaded: dict, expected: torch.nn.Module | dict) -> None:
    if isinstance(expected, torch.nn.Module):
        expected = expected.state_dict()
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_make_tiny_writes_every_model(tiny_models):
    assert set(tiny_models) == EXPECTED_KEYS
    for name, path in tiny_models.items():
        assert path.exists(), name
    assert tiny_models["t2v"].parent.name == "diffusion_models"
    assert tiny_models["vae"].parent.name == "vae"
    assert tiny_models["text_encoder"].parent.name == "text_encoders"


def test_make_tiny_is_deterministic(tiny_models, tmp_path):
    again = tiny.make_tiny(tmp_path)
    for name in ("t2v", "vace", "vace_module", "vae", "text_encoder", "t2v_gguf_q8_0", "t2v_gguf_q4_k"):
        assert again[name].read_bytes() == tiny_models[name].read_bytes(), name
    for component in ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors"):
        first = (tiny_models["diffusers_vace"] / component).read_bytes()
        assert (again["diffusers_vace"] / component).read_bytes() == first


@pytest.mark.parametrize(("key", "model"), [("t2v", "t2v"), ("vace", "vace")])
def test_transformer_files_convert_back_with_diffusers(tiny_models, tiny_reference, key, model):
    original = load_file(tiny_models[key])
    assert "patch_embedding.weight" in original and "blocks.0.self_attn.q.weight" in original
    assert_same_state(convert_wan_transformer_to_diffusers(original), getattr(tiny_reference, model))


def test_transformer_metadata_carries_head_count(tiny_models):
    for key in ("t2v", "vace", "vace_module"):
        with safe_open(tiny_models[key], "pt") as handle:
            assert handle.metadata()["num_heads"] == "4"


def test_vace_layout_and_module(tiny_models, tiny_reference):
    full = load_file(tiny_models["vace"])
    module = load_file(tiny_models["vace_module"])
    base = load_file(tiny_models["t2v"])
    assert module.keys() == {key for key in full if key.startswith("vace_")}
    assert {key for key in full if not key.startswith("vace_")} == set(base)
    assert all(torch.equal(full[key], base[key]) for key in base)
    assert "vace_blocks.0.before_proj.weight" in module and "vace_blocks.1.before_proj.weight" not in module
    assert "vace_blocks.1.after_proj.weight" in module
    assert tiny_reference.vace.config.vace_layers == [0, 2]
    assert module["vace_patch_embedding.weight"].shape[1] == 96


def test_vae_file_converts_back_with_diffusers(tiny_models, tiny_reference):
    original = load_file(tiny_models["vae"])
    assert {"encoder.conv1.weight", "conv1.weight", "conv2.weight", "decoder.conv1.weight"} <= set(original)
    assert_same_state(convert_wan_vae_to_diffusers(original), tiny_reference.vae)


def test_text_encoder_file_is_comfy_umt5_layout(tiny_models, tiny_reference):
    original = load_file(tiny_models["text_encoder"])
    spiece = original.pop(tiny.SPIECE_KEY)
    assert spiece.dtype == torch.uint8
    tokenizer = sentencepiece.SentencePieceProcessor(model_proto=spiece.numpy().tobytes())
    assert (tokenizer.pad_id(), tokenizer.eos_id(), tokenizer.unk_id(), tokenizer.bos_id()) == (0, 1, 2, -1)
    assert "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" in original
    assert "encoder.block.0.layer.1.DenseReluDense.wi_1.weight" in original
    expected = tiny_reference.text_encoder.state_dict()
    expected.pop("encoder.embed_tokens.weight")
    assert_same_state(original, expected)


def test_pipeline_folders_load_with_diffusers(tiny_models, tiny_reference):
    for key, model_class, reference in (("diffusers_t2v", WanTransformer3DModel, tiny_reference.t2v),
                                        ("diffusers_vace", WanVACETransformer3DModel, tiny_reference.vace)):
        folder = tiny_models[key]
        index = json.loads((folder / "model_index.json").read_text())
        assert {"transformer", "vae", "text_encoder", "tokenizer", "scheduler"} <= set(index)
        assert (folder / "tokenizer" / "spiece.model").read_bytes() == tiny_reference.spiece_model
        assert_same_state(model_class.from_pretrained(folder / "transformer").state_dict(), reference)
    folder = tiny_models["diffusers_t2v"]
    assert_same_state(AutoencoderKLWan.from_pretrained(folder / "vae").state_dict(), tiny_reference.vae)
    text_encoder = UMT5EncoderModel.from_pretrained(folder / "text_encoder")
    assert_same_state(text_encoder.state_dict(), tiny_reference.text_encoder)
    scheduler = UniPCMultistepScheduler.from_pretrained(folder / "scheduler")
    assert scheduler.config.prediction_type == "flow_prediction"
    assert scheduler.config.use_flow_sigmas and scheduler.config.flow_shift == 3.0


def test_tiny_shapes(tiny_reference):
    t2v, vae = tiny_reference.t2v.config, tiny_reference.vae.config
    assert (t2v.num_attention_heads, t2v.attention_head_dim, t2v.num_layers, t2v.ffn_dim) == (4, 32, 4, 256)
    assert (t2v.text_dim, t2v.freq_dim, t2v.in_channels, tuple(t2v.patch_size)) == (64, 256, 16, (1, 2, 2))
    assert vae.latents_mean[0] == WAN_LATENTS_MEAN_FIRST and vae.latents_std[0] == WAN_LATENTS_STD_FIRST
    assert tiny_reference.text_encoder.config.d_model == 64


def test_tiny_models_give_useful_outputs(tiny_reference):
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 2, 4, 4, generator=generator)
    text = torch.randn(1, 7, 64, generator=generator)
    with torch.no_grad():
        prediction = tiny_reference.t2v(latents, torch.tensor([500]), text, return_dict=False)[0]
        video = torch.rand(1, 3, 5, 16, 16, generator=generator) * 2 - 1
        latent = tiny_reference.vae.encode(video).latent_dist.mode()
        decoded = tiny_reference.vae.decode(latent).sample
    assert prediction.shape == latents.shape and torch.isfinite(prediction).all()
    assert 0.05 < prediction.std() < 20
    assert latent.shape == (1, 16, 2, 2, 2)  # 4x temporal, 8x spatial
    assert decoded.shape == video.shape and torch.isfinite(decoded).all() and decoded.std() > 1e-3
