"""Model loading: every accepted format gives the reference weights, and bad input gives a clear error."""

from __future__ import annotations

import shutil

import pytest
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from wanmesh.parallel.weights.checkpoint import CheckpointFile, ModelFileError, read_tensor
from wanmesh.parallel.weights.umt5_files import load_text_encoder
from wanmesh.parallel.weights.loaders import load_transformer, load_vae
from wanmesh.parallel.weights.detect import infer_transformer_config
from wanmesh.parallel.weights.quantized import read_weights

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def same_weights(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = read_weights(model)
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name].float(), tensor.float()), name


def transformer_output(model: torch.nn.Module, **extra) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 16, 2, 4, 4, generator=generator)
    text = torch.randn(1, 5, 64, generator=generator)
    with torch.no_grad():
        return model(latents, torch.tensor([700]), text, return_dict=False, **extra)[0]


def metadata_of(path) -> dict:
    with safe_open(path, "pt") as handle:
        return handle.metadata() or {}


def write_variant(source, target, convert) -> None:
    """Re-save a file with every tensor passed through `convert(name, tensor) -> {name: tensor}`."""
    variant = {}
    for name, tensor in load_file(source).items():
        variant.update(convert(name, tensor))
    save_file(variant, target, metadata=metadata_of(source))


def is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and name.endswith(".weight") and tensor.is_floating_point()


def to_fp8(name, tensor):
    return {name: tensor.to(FP8) if is_linear_weight(name, tensor) else tensor}


def to_scaled_fp8(name, tensor):
    if not is_linear_weight(name, tensor):
        return {name: tensor}
    scale = tensor.abs().max() / FP8_MAX
    base = name.removesuffix(".weight")
    return {name: (tensor / scale).to(FP8), f"{base}.scale_weight": scale.reshape(()),
            f"{base}.scale_input": torch.ones(())}


def fp8_expected(reference: dict, scaled: bool) -> dict:
    expected = {}
    for name, tensor in reference.items():
        if is_linear_weight(name, tensor):
            scale = tensor.abs().max() / FP8_MAX if scaled else torch.tensor(1.0)
            tensor = (tensor / scale).to(FP8).float() * scale
        expected[name] = tensor
    return expected


# --- transformers -----------------------------------------------------------------------------------

def test_t2v_file_loads_exactly(tiny_models, tiny_reference):
    model = load_transformer(str(tiny_models["t2v"]))
    assert type(model) is WanTransformer3DModel and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    same_weights(model, tiny_reference.t2v.state_dict())


def test_vace_file_and_module_merge_load_exactly(tiny_models, tiny_reference):
    full = load_transformer(str(tiny_models["vace"]))
    merged = load_transformer(str(tiny_models["t2v"]), vace_module=str(tiny_models["vace_module"]))
    assert full.config.vace_layers == merged.config.vace_layers == [0, 2]
    same_weights(full, tiny_reference.vace.state_dict())
    same_weights(merged, tiny_reference.vace.state_dict())


def test_comfy_file_matches_diffusers_folder(tiny_models):
    ours = load_transformer(str(tiny_models["t2v"]))
    reference = WanTransformer3DModel.from_pretrained(tiny_models["diffusers_t2v"] / "transformer").eval()
    expected = transformer_output(reference)
    # diffusers' own loader may lay tensors out differently in memory, so kernels round differently (~1e-6)
    torch.testing.assert_close(transformer_output(ours), expected, rtol=1e-5, atol=1e-5)
    from_folder = load_transformer(str(tiny_models["diffusers_t2v"]))
    torch.testing.assert_close(transformer_output(from_folder), transformer_output(ours), rtol=0, atol=0)


def test_vace_module_merge_gives_same_output(tiny_models):
    control = torch.randn(1, 96, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    full = load_transformer(str(tiny_models["diffusers_vace"]))
    merged = load_transformer(str(tiny_models["t2v"]), vace_module=str(tiny_models["vace_module"]))
    torch.testing.assert_close(transformer_output(merged, control_hidden_states=control),
                               transformer_output(full, control_hidden_states=control), rtol=0, atol=0)


def test_module_merges_onto_diffusers_folder_base(tiny_models, tiny_reference):
    merged = load_transformer(str(tiny_models["diffusers_t2v"]), vace_module=str(tiny_models["vace_module"]))
    same_weights(merged, tiny_reference.vace.state_dict())


def test_comfy_prefix_is_stripped(tiny_models, tiny_reference, tmp_path):
    prefixed = tmp_path / "prefixed.safetensors"
    write_variant(tiny_models["t2v"], prefixed, lambda name, t: {f"model.diffusion_model.{name}": t})
    same_weights(load_transformer(str(prefixed)), tiny_reference.t2v.state_dict())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_files(tiny_models, tiny_reference, tmp_path, dtype):
    path = tmp_path / "half.safetensors"
    write_variant(tiny_models["t2v"], path, lambda name, t: {name: t.to(dtype)})
    expected = {name: t.to(dtype).float() for name, t in tiny_reference.t2v.state_dict().items()}
    same_weights(load_transformer(str(path)), expected)


@pytest.mark.parametrize("scaled", [False, True])
def test_fp8_files_dequantise(tiny_models, tiny_reference, tmp_path, scaled):
    path = tmp_path / "fp8.safetensors"
    write_variant(tiny_models["t2v"], path, to_scaled_fp8 if scaled else to_fp8)
    if scaled:
        tensors = load_file(path)
        save_file({**tensors, "scaled_fp8": torch.empty(0, dtype=FP8)}, path, metadata=metadata_of(tiny_models["t2v"]))
    expected = fp8_expected(tiny_reference.t2v.state_dict(), scaled)
    model = load_transformer(str(path))
    same_weights(model, expected)
    if scaled:  # the scale really matters: unscaled fp8 values differ
        assert not torch.equal(model.blocks[0].attn1.to_q.weight, tiny_reference.t2v.blocks[0].attn1.to_q.weight)


def test_scaled_fp8_slices_match_full_read(tiny_models, tmp_path):
    path = tmp_path / "scaled.safetensors"
    write_variant(tiny_models["t2v"], path, to_scaled_fp8)
    checkpoint = CheckpointFile(path)
    full = read_tensor(checkpoint, "blocks.1.ffn.0.weight", torch.float32)
    part = read_tensor(checkpoint, "blocks.1.ffn.0.weight", torch.float32, (slice(64, 128),))
    assert torch.equal(part, full[64:128])


def test_reduced_dtype_keeps_fp32_modules(tiny_models):
    model = load_transformer(str(tiny_models["t2v"]), dtype=torch.bfloat16)
    assert model.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert model.blocks[0].scale_shift_table.dtype == torch.float32
    assert model.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32


def test_weights_only_pickle_loads(tiny_models, tiny_reference, tmp_path):
    path = tmp_path / "wan.pt"
    torch.save(load_file(tiny_models["t2v"]), path)
    model = load_transformer(str(path))
    same_weights(model, tiny_reference.t2v.state_dict())
    assert model.config.num_attention_heads == 1  # pickles carry no num_heads metadata: dim / 128
    torch.save({"state_dict": load_file(tiny_models["vae"])}, tmp_path / "vae.ckpt")
    same_weights(load_vae(str(tmp_path / "vae.ckpt")), tiny_reference.vae.state_dict())


def test_infer_config_defaults_heads_from_dim():
    shapes = {"patch_embedding.weight": (5120, 16, 1, 2, 2), "head.head.weight": (64, 5120),
              "text_embedding.0.weight": (5120, 4096), "time_embedding.0.weight": (5120, 256),
              "blocks.0.ffn.0.weight": (13824, 5120), "blocks.39.ffn.0.weight": (13824, 5120),
              "blocks.0.norm3.weight": (5120,), "blocks.0.self_attn.norm_q.weight": (5120,),
              **{f"vace_blocks.{i}.after_proj.weight": (5120, 5120) for i in range(8)},
              "vace_patch_embedding.weight": (5120, 96, 1, 2, 2)}
    config = infer_transformer_config(shapes, None)
    assert config["num_attention_heads"] == 40 and config["attention_head_dim"] == 128
    assert config["num_layers"] == 40 and config["ffn_dim"] == 13824 and config["out_channels"] == 16
    assert config["vace_layers"] == [0, 5, 10, 15, 20, 25, 30, 35]


# --- VAE and text encoder ---------------------------------------------------------------------------

def test_vae_file_and_folder_load_exactly(tiny_models, tiny_reference):
    same_weights(load_vae(str(tiny_models["vae"])), tiny_reference.vae.state_dict())
    from_pipeline = load_vae(str(tiny_models["diffusers_t2v"]))
    from_model_folder = load_vae(str(tiny_models["diffusers_t2v"] / "vae"))
    same_weights(from_pipeline, tiny_reference.vae.state_dict())
    same_weights(from_model_folder, tiny_reference.vae.state_dict())
    reference = AutoencoderKLWan.from_pretrained(tiny_models["diffusers_t2v"] / "vae").eval()
    latent = torch.randn(1, 16, 2, 2, 2, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(from_pipeline.decode(latent).sample, reference.decode(latent).sample,
                                   rtol=1e-5, atol=1e-5)


def test_text_encoder_file_and_folders_load_exactly(tiny_models, tiny_reference):
    expected = tiny_reference.text_encoder.state_dict()
    for path in (tiny_models["text_encoder"], tiny_models["diffusers_t2v"],
                 tiny_models["diffusers_t2v"] / "text_encoder"):
        encoder = load_text_encoder(str(path))
        same_weights(encoder.model, expected)
        assert encoder.model.shared.weight.data_ptr() == encoder.model.encoder.embed_tokens.weight.data_ptr()


def test_scaled_fp8_text_encoder(tiny_models, tiny_reference, tmp_path):
    path = tmp_path / "umt5_fp8_scaled.safetensors"
    write_variant(tiny_models["text_encoder"], path,
                  lambda name, t: {name: t} if name == "spiece_model" else to_scaled_fp8(name, t))
    expected = fp8_expected(tiny_reference.text_encoder.state_dict(), scaled=True)
    expected["encoder.embed_tokens.weight"] = expected["shared.weight"]
    same_weights(load_text_encoder(str(path)).model, expected)


# --- errors -----------------------------------------------------------------------------------------

def test_missing_file_names_searched_folder(tiny_models):
    missing = tiny_models["t2v"].parent / "nope.safetensors"
    with pytest.raises(ModelFileError, match=r"nope\.safetensors.*searched folder .*diffusion_models.*wan_tiny"):
        load_transformer(str(missing))
    with pytest.raises(ModelFileError, match="does not exist"):
        load_vae(str(tiny_models["vae"].parent / "no_folder" / "x.safetensors"))


def test_not_safetensors_and_truncated_files(tiny_models, tmp_path):
    text_file = tmp_path / "notes.safetensors"
    text_file.write_text("this is not a model at all, just some text")
    with pytest.raises(ModelFileError, match=r"notes\.safetensors.*not a valid safetensors file \(file is \d+ bytes"):
        load_transformer(str(text_file))
    tiny_file = tmp_path / "empty.safetensors"
    tiny_file.write_bytes(b"\x01")
    with pytest.raises(ModelFileError, match="too short"):
        load_vae(str(tiny_file))
    truncated = tmp_path / "truncated.safetensors"
    data = tiny_models["t2v"].read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="truncated safetensors file"):
        load_transformer(str(truncated))
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes((10).to_bytes(8, "little") + b"{not json}" + b"\0" * 32)
    with pytest.raises(ModelFileError, match="corrupt safetensors header"):
        load_transformer(str(corrupt))


@pytest.mark.parametrize(("loader", "key", "looks_like"), [
    (load_transformer, "vae", r"looks like a Wan VAE, 2.1 or 2.2 \(keys encoder\.\*/decoder\.\*\)"),
    (load_transformer, "text_encoder", "looks like a umT5 text encoder"),
    (load_vae, "t2v", "looks like a Wan text-to-video transformer"),
    (load_vae, "text_encoder", "looks like a umT5 text encoder"),
    (load_text_encoder, "vae", "looks like a Wan VAE"),
    (load_text_encoder, "vace", "looks like a full Wan VACE transformer"),
])
def test_wrong_kind_of_file(tiny_models, loader, key, looks_like):
    with pytest.raises(ModelFileError, match=looks_like):
        loader(str(tiny_models[key]))


def test_vace_module_misuse(tiny_models):
    with pytest.raises(ModelFileError, match="VACE module .*pass this file as its VACE module"):
        load_transformer(str(tiny_models["vace_module"]))
    with pytest.raises(ModelFileError, match="full VACE model"):
        load_transformer(str(tiny_models["t2v"]), vace_module=str(tiny_models["vace"]))
    with pytest.raises(ModelFileError, match="already a VACE model"):
        load_transformer(str(tiny_models["vace"]), vace_module=str(tiny_models["vace_module"]))
    with pytest.raises(ModelFileError, match="expected a VACE module.*looks like a Wan VAE"):
        load_transformer(str(tiny_models["t2v"]), vace_module=str(tiny_models["vae"]))


def test_image_to_video_files_load_with_their_image_inputs(tiny_models):
    expected = {"i2v": (36, 1280, None), "flf2v": (36, 1280, 514), "i2v_high": (36, None, None)}
    for name, (channels, image_dim, positions) in expected.items():
        config = load_transformer(str(tiny_models[name])).config
        assert (config.in_channels, config.image_dim, config.pos_embed_seq_len) == (channels, image_dim, positions)


def test_missing_tensor_is_named(tiny_models, tmp_path):
    path = tmp_path / "incomplete.safetensors"
    tensors = load_file(tiny_models["t2v"])
    del tensors["blocks.3.cross_attn.k.weight"]
    save_file(tensors, path, metadata={"num_heads": "4"})
    with pytest.raises(ModelFileError, match=r"incomplete\.safetensors.*missing 1 tensors: blocks\.3\.attn2\.to_k\.weight"):
        load_transformer(str(path))


def test_unsafe_pickle_is_refused(tmp_path):
    path = tmp_path / "unsafe.ckpt"
    torch.save({"weights": torch.zeros(2), "callback": shutil.copy}, path)
    with pytest.raises(ModelFileError, match="weights-only"):
        load_vae(str(path))


def test_folder_errors(tiny_models, tmp_path):
    with pytest.raises(ModelFileError, match="neither|expected config.json .* or model_index.json"):
        load_transformer(str(tmp_path))
    with pytest.raises(ModelFileError, match="describes a AutoencoderKLWan; expected a Wan transformer"):
        load_transformer(str(tiny_models["diffusers_t2v"] / "vae"))
    pipeline = tmp_path / "pipeline"
    shutil.copytree(tiny_models["diffusers_t2v"], pipeline)
    (pipeline / "tokenizer" / "spiece.model").unlink()
    with pytest.raises(ModelFileError, match=r"No SentencePiece tokenizer .*spiece\.model"):
        load_text_encoder(str(pipeline))
    shutil.rmtree(pipeline / "transformer")
    with pytest.raises(ModelFileError, match="has no 'transformer/config.json'"):
        load_transformer(str(pipeline))


def test_text_encoder_without_tokenizer_bytes(tiny_models, tmp_path):
    path = tmp_path / "umt5_no_tokenizer.safetensors"
    tensors = load_file(tiny_models["text_encoder"])
    del tensors["spiece_model"]
    save_file(tensors, path)
    with pytest.raises(ModelFileError, match="without a 'spiece_model' tensor"):
        load_text_encoder(str(path))
