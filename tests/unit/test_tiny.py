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

from wanmesh.parallel.weights.checkpoint import build_empty
from wanmesh.parallel.weights.loaders import load_transformer
from wanmesh.parallel.tiny import models as tiny
from wanmesh.parallel.tiny.files import MEDIUM_FILES, TINY_FILES
from wanmesh.parallel.tiny.fp8_write import write_fp8_file

EXPECTED_KEYS = {"t2v", "vace", "vae", "text_encoder", "vace_module", "diffusers_t2v", "diffusers_vace",
                 "t2v_gguf_q8_0", "t2v_gguf_q4_k", "t2v_fp8_scaled",
                 "lora_comfy", "lora_peft", "lora_kohya", "lora_diff", "t2v_low",
                 "model_native", "vace_native", "text_encoder_native", "i2v", "flf2v", "i2v_high", "i2v_low", "clip_vision",
                 "ti2v", "vae22", "fun_inp", "fun_control", "fun22_control",
                 "fun22_5b_control", "animate", "fun_camera", "fun22_camera"}
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
    for name in ("t2v", "vace", "vace_module", "vae", "text_encoder", "t2v_gguf_q8_0", "t2v_gguf_q4_k",
                 "t2v_fp8_scaled", "model_native", "vace_native", "text_encoder_native"):
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


def _forward(model: torch.nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 2, 8, 8, generator=generator)
    text = torch.randn(1, 7, 64, generator=generator)
    with torch.no_grad():
        return model(latents, torch.tensor([500]), text, return_dict=False)[0]


def _relative_error(model_file, reference: torch.Tensor) -> float:
    return float((_forward(load_transformer(str(model_file))) - reference).norm() / reference.norm())


def test_scaled_fp8_file_has_comfy_layout_and_is_close_to_the_float_model(tiny_models):
    assert tiny_models["t2v_fp8_scaled"] == tiny_models["t2v"].parent.parent / TINY_FILES["model_fp8_scaled"]
    stored, base = load_file(tiny_models["t2v_fp8_scaled"]), load_file(tiny_models["t2v"])
    marker = stored.pop("scaled_fp8")
    assert marker.dtype == torch.float8_e4m3fn and marker.numel() == 0
    scales = {key: stored.pop(key) for key in list(stored) if key.endswith(".scale_weight")}
    assert set(stored) == set(base)
    fp8_keys = {key for key, tensor in stored.items() if tensor.dtype == torch.float8_e4m3fn}
    assert "blocks.0.ffn.0.weight" in fp8_keys and "blocks.3.cross_attn.o.weight" in fp8_keys
    assert not {key for key in fp8_keys if not key.startswith("blocks.")} and len(fp8_keys) == 4 * 10
    assert {key.replace(".scale_weight", ".weight") for key in scales} == fp8_keys
    for key in fp8_keys:
        scale = scales[key.replace(".weight", ".scale_weight")]
        assert scale.dtype == torch.float32 and scale.shape == ()
        assert float(scale) == pytest.approx(float(base[key].abs().max()) / 448, rel=1e-6)
    assert stored["blocks.0.norm3.weight"].dtype == torch.float32 and stored["head.modulation"].dtype == torch.float32
    with safe_open(tiny_models["t2v_fp8_scaled"], "pt") as handle:
        assert handle.metadata()["num_heads"] == "4"
    reference = _forward(load_transformer(str(tiny_models["t2v"])))
    assert _relative_error(tiny_models["t2v_fp8_scaled"], reference) < 0.05


@pytest.mark.parametrize(("dtype", "scaled", "tolerance"), [
    (torch.float8_e4m3fn, False, 0.05), (torch.float8_e5m2, False, 0.1), (torch.float8_e5m2, True, 0.1)])
def test_fp8_writer_files_load_close_to_the_float_model(tiny_models, tmp_path, dtype, scaled, tolerance):
    state = load_file(tiny_models["t2v"])
    path = write_fp8_file(state, tmp_path / "model.safetensors", dtype, scaled=scaled, metadata={"num_heads": "4"})
    stored = load_file(path)
    assert stored["blocks.1.self_attn.q.weight"].dtype == dtype and stored["text_embedding.0.weight"].dtype == torch.float32
    assert ("scaled_fp8" in stored) == scaled and ("blocks.1.self_attn.q.scale_weight" in stored) == scaled
    reference = _forward(load_transformer(str(tiny_models["t2v"])))
    assert _relative_error(path, reference) < tolerance


def test_medium_preset_is_about_150m_parameters_with_the_tiny_text_dim():
    model = build_empty(lambda: WanTransformer3DModel(**tiny.MEDIUM_TRANSFORMER))
    config = model.config
    assert (config.num_attention_heads, config.attention_head_dim, config.num_layers) == (16, 64, 8)
    assert config.ffn_dim == 4 * 1024 and config.text_dim == tiny.TINY_UMT5["d_model"]
    assert 130e6 < sum(parameter.numel() for parameter in model.parameters()) < 170e6


def test_medium_preset_writes_every_format(tmp_path, monkeypatch, tiny_models):
    monkeypatch.setattr(tiny, "MEDIUM_TRANSFORMER", tiny.TINY_TRANSFORMER)  # the same writers, at the tiny size
    paths = tiny.make_models(tmp_path, "medium")
    assert set(paths) == set(MEDIUM_FILES) and all(path.is_file() for path in paths.values())
    assert paths["vae"].read_bytes() == tiny_models["vae"].read_bytes()
    assert paths["text_encoder"].read_bytes() == tiny_models["text_encoder"].read_bytes()
    bf16 = load_file(paths["model"])
    assert {tensor.dtype for tensor in bf16.values()} == {torch.bfloat16}
    assert load_file(paths["model_fp8_scaled"])["blocks.0.ffn.2.weight"].dtype == torch.float8_e4m3fn
    reference = _forward(load_transformer(str(paths["model"])))
    for name, tolerance in (("model_fp8_scaled", 0.05), ("model_gguf", 0.02), ("model_gguf_q4_k", 0.2)):
        assert _relative_error(paths[name], reference) < tolerance, name
    with pytest.raises(ValueError, match="preset 'huge' is unknown"):
        tiny.make_models(tmp_path, "huge")


@pytest.mark.parametrize("name, image_kind, in_channels", [
    ("fun_inp", "clip_vision", 36), ("fun_control", "fun_control", 48), ("ti2v", "first_frame", 48),
    ("fun22_control", "fun_control", 52), ("fun22_5b_control", "first_frame", 148)])
def test_fun_files_are_told_by_their_tensors(tiny_models, name, image_kind, in_channels):
    """Fun Control's 48 input channels are not TI2V 5B's (its output has 16); Fun InP is Wan 2.1 I2V's layout."""
    from wanmesh.parallel.validation import model_image_inputs

    assert model_image_inputs(tiny_models[name]) == (in_channels, image_kind)
