"""Tiny random Wan / VACE / VAE / umT5 models in the file formats users have (`wanmesh make-tiny DIR`), and the
medium preset (`--preset medium`: a ~150M-parameter T2V transformer as bf16, scaled fp8, Q8_0 and Q4_K GGUF, for
measuring memory and speed); runs in the CLI process and tests.

Everything is deterministic (fixed seeds, single-threaded tokenizer training), so the same files come
out every time. Single files use the ORIGINAL key layouts; the original names are generated from the
config and proven by mapping them through diffusers' own key converters back onto exactly the model's
state-dict keys. Pipeline folders in diffusers layout are written beside them. Single files are written
atomically (a temporary file renamed into place), so an interrupted run leaves no partial model behind.
"""

from __future__ import annotations

import contextlib
import io
import math
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece
import torch
from diffusers import (
    AutoencoderKLWan,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
    WanVACEPipeline,
    WanVACETransformer3DModel,
)
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers, convert_wan_vae_to_diffusers
from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel
from transformers.utils import logging as transformers_logging

from ..networks.wan_camera import WanCameraTransformer3DModel
from ..weights.checkpoint import rename_map
from ..weights.loaders import convert_wan_transformer_keys
from ..weights.detect import REF_CONV_CHANNELS
from ..networks.reference import add_reference_conv
from ..weights.umt5_files import SPIECE_FILENAME, SPIECE_KEY
from ..tensor_files import save_tensors_atomic
from .files import MEDIUM_FILES, TINY_FILES

SEED = 20250101

TINY_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=16, out_channels=16,
    text_dim=64, freq_dim=256, ffn_dim=256, num_layers=4, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6,
)
TINY_VACE = dict(TINY_TRANSFORMER, vace_layers=[0, 2], vace_in_channels=96)
# The medium preset: about 143M parameters (dim 1024, 8 layers, 16 heads of 64, FFN 4x), the tiny umT5's text dim.
MEDIUM_TRANSFORMER = dict(TINY_TRANSFORMER, num_attention_heads=16, attention_head_dim=64, ffn_dim=4096, num_layers=8)
# What ComfyUI's own Wan loader can read (it takes heads of 128 and a text width of 4096, umT5-XXL's): the native
# twins of the tiny T2V and VACE models and a tiny umT5 of that width, for comparisons with ComfyUI's Wan code.
NATIVE_TRANSFORMER = dict(TINY_TRANSFORMER, num_attention_heads=2, attention_head_dim=128, text_dim=4096,
                          ffn_dim=512, num_layers=2)
NATIVE_VACE = dict(NATIVE_TRANSFORMER, vace_layers=[0], vace_in_channels=96)
# Image-to-video, native-loadable like the twins: Wan 2.1 I2V (36 input channels, CLIP vision tokens through an image
# embedding of width 1280 and an image cross-attention), FLF2V (two images' tokens with a position embedding) and
# the Wan 2.2 I2V A14B experts (36 input channels, no image tokens).
NATIVE_I2V = dict(NATIVE_TRANSFORMER, in_channels=36, image_dim=1280, added_kv_proj_dim=256)
NATIVE_FLF2V = dict(NATIVE_I2V, pos_embed_seq_len=2 * 257)
NATIVE_I2V_EXPERT = dict(NATIVE_TRANSFORMER, in_channels=36)
# Wan 2.1 Fun: InP has Wan 2.1 I2V's layout (36 input channels, image tokens); Control takes 48 (the noise, the
# control video's and the start image's latents) and has the image embedding too.
NATIVE_FUN_INP = NATIVE_I2V
NATIVE_FUN_CONTROL = dict(NATIVE_I2V, in_channels=48)
# Wan 2.2 Animate, native-loadable: the I2V layout with five blocks (one face adapter block, after block 0) and the
# Animate modules, whose encoder sizes are fixed by the released model (``networks/wan_animate.py``)
NATIVE_ANIMATE = dict(NATIVE_I2V, num_layers=5)
# Wan 2.1 Fun Camera: the noise and the start image's latents (32 channels in), image tokens, the camera adapter
NATIVE_FUN_CAMERA = dict(NATIVE_I2V, in_channels=32, camera_in_channels=24)
# Wan 2.2 Fun Camera A14B: the I2V expert layout (36 channels in: noise, 4 mask channels, start latents; no image
# tokens) with the camera adapter
NATIVE_FUN22_CAMERA = dict(NATIVE_I2V_EXPERT, camera_in_channels=24)
# Wan 2.2 TI2V 5B, native-loadable: the 48-channel Wan 2.2 latent in and out (text- and image-to-video)
NATIVE_TI2V = dict(NATIVE_TRANSFORMER, in_channels=48, out_channels=48)
# Wan 2.2 Fun Control A14B: 52 channels in (control latents, 4 mask channels, start latents), no image tokens, and
# the reference image's ref_conv on 16-channel latents (REF_CONV_CHANNELS: not a diffusers config key)
NATIVE_FUN22_CONTROL = dict(NATIVE_TRANSFORMER, in_channels=52, **{REF_CONV_CHANNELS: 16})
# Wan 2.2 Fun 5B Control: TI2V 5B's 48-channel latents, 148 channels in, the reference on 48-channel latents
NATIVE_FUN22_5B_CONTROL = dict(NATIVE_TI2V, in_channels=148, **{REF_CONV_CHANNELS: 48})
TINY_VAE = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                temperal_downsample=[False, True, True])
TINY_UMT5 = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                 relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
                 is_encoder_decoder=False, use_cache=False, pad_token_id=0, eos_token_id=1,
                 decoder_start_token_id=0)
NATIVE_UMT5 = dict(TINY_UMT5, d_model=4096)
TOKENIZER_VOCAB_SIZE = 384

CORPUS = """\
A cat sits on a red sofa in the warm afternoon light.
The camera slowly pans across a quiet mountain lake at sunrise.
A dog runs along the beach, splashing through the shallow waves.
Two astronauts walk on the surface of the moon while dust rises behind them.
A cyclist rides through a busy city street as rain falls on the road.
An old man plays the violin under a bridge at night.
A little girl blows bubbles in a green garden full of flowers.
Waves crash against the rocks of a lighthouse during a storm.
A chef chops vegetables quickly in a bright modern kitchen.
A red fox jumps over a snowy log in a pine forest.
Fireworks explode above the river and reflect on the water.
A hot air balloon drifts over golden fields in the morning.
The train moves through a tunnel and comes out into the valley.
A robot dances on a stage with colorful lights and smoke.
Close up of a bee collecting pollen from a yellow sunflower.
Time lapse of clouds moving over a desert canyon.
A woman in a blue dress walks through a crowded market.
A small boat sails across the ocean under a cloudy sky.
Children play football on a dusty field at sunset.
Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, images, still.
Worst quality, low quality, JPEG compression residue, ugly, incomplete, extra fingers, poorly drawn hands.
Poorly drawn faces, deformed, disfigured, misshapen limbs, fused fingers, still picture, messy background.
Three legs, many people in the background, walking backwards, cinematic, realistic, high detail, 4k.
"""


@dataclass
class TinyModels:
    """The in-memory tiny models; the files `make_tiny` writes hold exactly these weights."""

    t2v: WanTransformer3DModel
    vace: WanVACETransformer3DModel
    vae: AutoencoderKLWan
    text_encoder: UMT5EncoderModel
    spiece_model: bytes


def train_tokenizer() -> bytes:
    """A small unigram SentencePiece model with umT5's special ids (pad 0, eos 1, unk 2, no BOS)."""
    model_bytes = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()), model_writer=model_bytes, model_type="unigram",
        vocab_size=TOKENIZER_VOCAB_SIZE, hard_vocab_limit=False, character_coverage=1.0,
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, num_threads=1, minloglevel=2,
    )
    return model_bytes.getvalue()


def _random_like(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=generator)
    if "scale_shift_table" in name:
        return noise * shape[-1] ** -0.5
    if name.endswith("bias") and "relative_attention_bias" not in name:
        return noise * 0.02
    if len(shape) == 1 or name.endswith("gamma"):
        return 1.0 + 0.05 * noise  # norm scales near one keep activations well-conditioned
    if name in ("shared.weight", "encoder.embed_tokens.weight") or "relative_attention_bias" in name:
        return noise * 0.5
    fan_in = math.prod(shape[1:])
    return noise * min(0.1, max(0.02, fan_in ** -0.5))


def randomise_(model: torch.nn.Module, seed: int, only: Callable[[str], bool] = lambda name: True) -> None:
    """Overwrite parameters (in name order) with seeded random values; tied parameters are filled once."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if only(name):
                parameter.copy_(_random_like(name, parameter.shape, generator))


def build_tiny_models(seed: int = SEED) -> TinyModels:
    """The tiny models; VACE shares every non-VACE weight with T2V so a module merge equals the full file."""
    t2v = WanTransformer3DModel(**TINY_TRANSFORMER)
    randomise_(t2v, seed)
    vace = WanVACETransformer3DModel(**TINY_VACE)
    vace.load_state_dict(t2v.state_dict(), strict=False)
    randomise_(vace, seed + 1, only=lambda name: name.startswith("vace_"))
    vae = build_tiny_vae(seed)
    spiece_model = train_tokenizer()
    vocab_size = sentencepiece.SentencePieceProcessor(model_proto=spiece_model).get_piece_size()
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=vocab_size, **TINY_UMT5))
    randomise_(text_encoder, seed + 3)
    for model in (t2v, vace, vae, text_encoder):
        model.eval().requires_grad_(False)
    return TinyModels(t2v, vace, vae, text_encoder, spiece_model)


def build_tiny_vae(seed: int = SEED) -> AutoencoderKLWan:
    """The tiny Wan 2.1 VAE (``build_tiny_models``' own, the same weights for the same seed)."""
    vae = AutoencoderKLWan(**TINY_VAE)
    randomise_(vae, seed + 2)
    return vae.eval().requires_grad_(False)


def original_vae_state(vae: AutoencoderKLWan) -> dict[str, torch.Tensor]:
    """A tiny Wan 2.1 VAE's weights in the released key layout."""
    return original_state_dict(vae, original_vae_names(TINY_VAE), convert_wan_vae_to_diffusers)


def build_tiny_low_noise_expert(seed: int = SEED) -> WanTransformer3DModel:
    """A second tiny T2V transformer, the low-noise expert of a tiny two-expert (Wan 2.2 A14B-like) pair:
    the tiny T2V's config, other weights."""
    expert = WanTransformer3DModel(**TINY_TRANSFORMER)
    randomise_(expert, seed + 4)
    return expert.eval().requires_grad_(False)


# --- original key layouts -------------------------------------------------------------------------

def _pairs(*names: str) -> list[str]:
    return [f"{name}.{suffix}" for name in names for suffix in ("weight", "bias")]


def _wan_block_names(prefix: str, image_tokens: bool = False) -> list[str]:
    names = [f"{prefix}.modulation"]
    for attention in ("self_attn", "cross_attn"):
        names += _pairs(*(f"{prefix}.{attention}.{proj}" for proj in "qkvo"))
        names += [f"{prefix}.{attention}.norm_q.weight", f"{prefix}.{attention}.norm_k.weight"]
    if image_tokens:
        names += _pairs(f"{prefix}.cross_attn.k_img", f"{prefix}.cross_attn.v_img")
        names += [f"{prefix}.cross_attn.norm_k_img.weight"]
    return names + _pairs(f"{prefix}.norm3", f"{prefix}.ffn.0", f"{prefix}.ffn.2")


def _image_embedding_names(config: dict) -> list[str]:
    if not config.get("image_dim"):
        return []
    names = _pairs("img_emb.proj.0", "img_emb.proj.1", "img_emb.proj.3", "img_emb.proj.4")
    return names + (["img_emb.emb_pos"] if config.get("pos_embed_seq_len") else [])


def original_transformer_names(config: dict) -> list[str]:
    """Original Wan key names for a config (`cross_attn_norm` and qk-norm layouts as released)."""
    names = _pairs("patch_embedding", "text_embedding.0", "text_embedding.2", "time_embedding.0",
                   "time_embedding.2", "time_projection.1", "head.head") + ["head.modulation"]
    for index in range(config["num_layers"]):
        names += _wan_block_names(f"blocks.{index}", image_tokens=bool(config.get("image_dim")))
    names += _image_embedding_names(config)
    for index in range(len(config.get("vace_layers", []))):
        names += _wan_block_names(f"vace_blocks.{index}") + _pairs(f"vace_blocks.{index}.after_proj")
        names += _pairs(f"vace_blocks.{index}.before_proj") if index == 0 else []
    if "vace_layers" in config:
        names += _pairs("vace_patch_embedding")
    if REF_CONV_CHANNELS in config:
        names += _pairs("ref_conv")
    if config.get("camera_in_channels"):
        names += _pairs("control_adapter.conv", "control_adapter.residual_blocks.0.conv1",
                        "control_adapter.residual_blocks.0.conv2")
    return names


def _vae_residual_names(prefix: str, in_dim: int, out_dim: int) -> list[str]:
    names = [f"{prefix}.residual.0.gamma", f"{prefix}.residual.3.gamma"]
    names += _pairs(f"{prefix}.residual.2", f"{prefix}.residual.6")
    return names + (_pairs(f"{prefix}.shortcut") if in_dim != out_dim else [])


def _vae_middle_names(prefix: str) -> list[str]:
    attention = [f"{prefix}.middle.1.norm.gamma"] + _pairs(f"{prefix}.middle.1.to_qkv", f"{prefix}.middle.1.proj")
    return _vae_residual_names(f"{prefix}.middle.0", 1, 1) + attention + _vae_residual_names(f"{prefix}.middle.2", 1, 1)


def _vae_resample_names(prefix: str, temporal: bool) -> list[str]:
    return _pairs(f"{prefix}.resample.1") + (_pairs(f"{prefix}.time_conv") if temporal else [])


def original_vae_names(config: dict) -> list[str]:
    """Original Wan 2.1 VAE key names (encoder downsamples / decoder upsamples as flat sequences)."""
    base, mult, res_blocks = config["base_dim"], config["dim_mult"], config["num_res_blocks"]
    levels = len(mult)
    names = _pairs("encoder.conv1", "conv1", "conv2", "decoder.conv1", "encoder.head.2", "decoder.head.2")
    names += ["encoder.head.0.gamma", "decoder.head.0.gamma"]
    names += _vae_middle_names("encoder") + _vae_middle_names("decoder")
    encoder_dims = [base * m for m in [1] + mult]
    index = 0
    for level, (in_dim, out_dim) in enumerate(zip(encoder_dims[:-1], encoder_dims[1:])):
        for _ in range(res_blocks):
            names += _vae_residual_names(f"encoder.downsamples.{index}", in_dim, out_dim)
            in_dim, index = out_dim, index + 1
        if level != levels - 1:
            names += _vae_resample_names(f"encoder.downsamples.{index}", config["temperal_downsample"][level])
            index += 1
    decoder_dims = [base * m for m in [mult[-1]] + mult[::-1]]
    temporal_upsample = config["temperal_downsample"][::-1]
    index = 0
    for level, (in_dim, out_dim) in enumerate(zip(decoder_dims[:-1], decoder_dims[1:])):
        in_dim = in_dim // 2 if level > 0 else in_dim  # each upsampling conv halves the channels
        for _ in range(res_blocks + 1):
            names += _vae_residual_names(f"decoder.upsamples.{index}", in_dim, out_dim)
            in_dim, index = out_dim, index + 1
        if level != levels - 1:
            names += _vae_resample_names(f"decoder.upsamples.{index}", temporal_upsample[level])
            index += 1
    return names


def diffusers_to_original(original_names: list[str], convert, model: torch.nn.Module) -> dict[str, str]:
    """{model key: original key}, proven by converting the original names back onto the model's keys."""
    names = rename_map(original_names, convert)
    model_keys = set(model.state_dict())
    if len(names) != len(original_names) or set(names) != model_keys:
        raise RuntimeError(
            f"original key layout does not round-trip for {type(model).__name__}: "
            f"unmatched {sorted(set(names) ^ model_keys)[:5]}"
        )
    return names


def original_state_dict(model: torch.nn.Module, original_names: list[str], convert) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    names = diffusers_to_original(original_names, convert, model)
    return {original: state[name].detach().clone().contiguous() for name, original in names.items()}


def original_text_encoder_state(model: UMT5EncoderModel, spiece_model: bytes) -> dict[str, torch.Tensor]:
    """ComfyUI's umT5 layout: transformers names, tied embedding stored once, tokenizer bytes included."""
    state = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()
             if name != "encoder.embed_tokens.weight"}
    state[SPIECE_KEY] = torch.from_numpy(np.frombuffer(spiece_model, dtype=np.uint8).copy())
    return state


# --- writing --------------------------------------------------------------------------------------

def _transformers_tokenizer(spiece_model: bytes) -> T5Tokenizer:
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / SPIECE_FILENAME).write_bytes(spiece_model)
        return T5Tokenizer.from_pretrained(folder, extra_ids=0)


def flow_scheduler() -> UniPCMultistepScheduler:
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


@contextlib.contextmanager
def _quiet_transformers_progress():
    """transformers shows a progress bar per saved model; for a few kilobytes it is only noise."""
    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()


def _write_pipeline(folder: Path, pipeline_class, transformer: torch.nn.Module, models: TinyModels) -> None:
    pipeline = pipeline_class(
        tokenizer=_transformers_tokenizer(models.spiece_model), text_encoder=models.text_encoder, vae=models.vae,
        scheduler=flow_scheduler(), transformer=transformer,
    )
    if folder.exists():
        shutil.rmtree(folder)
    with _quiet_transformers_progress():
        pipeline.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer" / SPIECE_FILENAME).write_bytes(models.spiece_model)


def _write_ggufs(state: dict[str, torch.Tensor], paths: dict[str, Path], heads: int) -> None:
    """A T2V state as the GGUF files users have: Q8_0 (``t2v_gguf_q8_0``) and Q4_K (``t2v_gguf_q4_k``; matrices
    whose input dim is not a whole number of 256-element blocks fall back to F16)."""
    from gguf import GGMLQuantizationType

    from .gguf_write import write_wan_gguf

    write_wan_gguf(state, paths["t2v_gguf_q8_0"], GGMLQuantizationType.Q8_0, num_heads=heads)
    write_wan_gguf(state, paths["t2v_gguf_q4_k"], GGMLQuantizationType.Q4_K, num_heads=heads)


def _write_scaled_fp8(state: dict[str, torch.Tensor], path: Path, heads: dict[str, str]) -> None:
    from .fp8_write import write_fp8_file

    write_fp8_file(state, path, torch.float8_e4m3fn, scaled=True, metadata=heads)


def _write_vae_and_text_encoder(models: TinyModels, paths: dict[str, Path]) -> None:
    vae_state = original_vae_state(models.vae)
    save_tensors_atomic(vae_state, paths["vae"])
    save_tensors_atomic(original_text_encoder_state(models.text_encoder, models.spiece_model), paths["text_encoder"])


def _transformer_state(model: torch.nn.Module, config: dict) -> dict[str, torch.Tensor]:
    return original_state_dict(model, original_transformer_names(config), convert_wan_transformer_keys)


def _head_metadata(config: dict) -> dict[str, str]:
    return {"num_heads": str(config["num_attention_heads"])}


FileProgress = Callable[[int, int, str], None]  # (n, N, what is being written), called before each write


def _write_all(root: Path, writes: list[tuple[str, Callable[[], object]]], progress: FileProgress | None) -> None:
    """Each ``(what, write)`` in turn, announced to ``progress`` (``what`` relative to ``root``) before it runs."""
    for index, (what, write) in enumerate(writes, 1):
        if progress is not None:
            progress(index, len(writes), str(Path(what).relative_to(root)) if Path(what).is_absolute() else what)
        write()


def make_tiny(directory: str | Path, progress: FileProgress | None = None) -> dict[str, Path]:
    """Write the tiny model tree under `directory` and return the path of each model; ``progress(n, N, what)`` is
    called before each file (or group of files) is written."""
    root = Path(directory)
    models = build_tiny_models()
    paths = {
        "t2v": root / "diffusion_models" / "wan_tiny_t2v.safetensors",
        "vace": root / "diffusion_models" / "wan_tiny_vace.safetensors",
        "vace_module": root / "diffusion_models" / "wan_tiny_vace_module.safetensors",
        "vae": root / "vae" / "wan_tiny_vae.safetensors",
        "text_encoder": root / "text_encoders" / "umt5_tiny.safetensors",
        "diffusers_t2v": root / "diffusers" / "wan_tiny_t2v",
        "diffusers_vace": root / "diffusers" / "wan_tiny_vace",
        "t2v_gguf_q8_0": root / "diffusion_models" / "wan_tiny_t2v_Q8_0.gguf",
        "t2v_gguf_q4_k": root / "diffusion_models" / "wan_tiny_t2v_Q4_K.gguf",
        "t2v_fp8_scaled": root / TINY_FILES["model_fp8_scaled"],
        "t2v_low": root / "diffusion_models" / "wan_tiny_t2v_low.safetensors",
    }
    heads = _head_metadata(TINY_TRANSFORMER)
    t2v_state = _transformer_state(models.t2v, TINY_TRANSFORMER)
    vace_state = _transformer_state(models.vace, TINY_VACE)
    module_state = {key: tensor for key, tensor in vace_state.items() if key.startswith("vace_")}
    _write_all(root, [
        (paths["t2v"], lambda: save_tensors_atomic(t2v_state, paths["t2v"], metadata=heads)),
        (f"{paths['t2v_gguf_q8_0'].relative_to(root)}, {paths['t2v_gguf_q4_k'].name}",
         lambda: _write_ggufs(t2v_state, paths, TINY_TRANSFORMER["num_attention_heads"])),
        (paths["t2v_fp8_scaled"], lambda: _write_scaled_fp8(t2v_state, paths["t2v_fp8_scaled"], heads)),
        (paths["vace"], lambda: save_tensors_atomic(vace_state, paths["vace"], metadata=heads)),
        (paths["vace_module"], lambda: save_tensors_atomic(module_state, paths["vace_module"], metadata=heads)),
        (f"{paths['vae'].relative_to(root)}, {paths['text_encoder'].relative_to(root)}",
         lambda: _write_vae_and_text_encoder(models, paths)),
        ("loras/ (one per format)", lambda: paths.update(_write_loras(root, t2v_state))),
        (paths["t2v_low"], lambda: save_tensors_atomic(_transformer_state(build_tiny_low_noise_expert(),
                                                                          TINY_TRANSFORMER), paths["t2v_low"],
                                                       metadata=heads)),
        (paths["diffusers_t2v"], lambda: _write_pipeline(paths["diffusers_t2v"], WanPipeline, models.t2v, models)),
        (paths["diffusers_vace"],
         lambda: _write_pipeline(paths["diffusers_vace"], WanVACEPipeline, models.vace, models)),
        ("the models ComfyUI loads natively (T2V, VACE, umT5)",
         lambda: paths.update(make_native_twins(root, models.spiece_model))),
        ("the image-to-video models, CLIP vision and the Wan 2.2 VAE",
         lambda: paths.update(make_image_to_video_models(root))),
    ], progress)
    return paths


IMAGE_TO_VIDEO_MODELS = {  # TINY_FILES name: (config, seed offset)
    "i2v": (NATIVE_I2V, 10), "flf2v": (NATIVE_FLF2V, 11), "i2v_high": (NATIVE_I2V_EXPERT, 12),
    "i2v_low": (NATIVE_I2V_EXPERT, 13), "ti2v": (NATIVE_TI2V, 14), "fun_inp": (NATIVE_FUN_INP, 15),
    "fun_control": (NATIVE_FUN_CONTROL, 16),
    "fun22_control": (NATIVE_FUN22_CONTROL, 30),
    "fun22_5b_control": (NATIVE_FUN22_5B_CONTROL, 31),
    "animate": (NATIVE_ANIMATE, 35),
    "fun_camera": (NATIVE_FUN_CAMERA, 25),
    "fun22_camera": (NATIVE_FUN22_CAMERA, 26),
}
ANIMATE_MODELS = ("animate",)  # built as Wan 2.2 Animate (``animate_state``)


def tiny_transformer(config: dict) -> WanTransformer3DModel:
    """diffusers' Wan transformer of a tiny config, with the reference ``ref_conv`` its config may name."""
    config = dict(config)
    ref_channels = config.pop(REF_CONV_CHANNELS, None)
    model = (WanCameraTransformer3DModel if "camera_in_channels" in config else WanTransformer3DModel)(**config)
    return model if ref_channels is None else add_reference_conv(model, ref_channels)


def make_image_to_video_models(root: Path, seed: int = SEED) -> dict[str, Path]:
    """The tiny image-to-video transformers (native-loadable, text width 4096: they take the native umT5 twin's
    embeddings; the Wan 2.2 TI2V 5B-like one on 48-channel latents, with the tiny Wan 2.2 VAE) and the tiny CLIP
    vision encoder their image tokens come from."""
    from .clip_vision import write_tiny_clip_vision
    from .vae22 import write_tiny_vae22

    paths = {}
    for name, (config, offset) in IMAGE_TO_VIDEO_MODELS.items():
        if name in ANIMATE_MODELS:
            state = animate_state(config, seed + offset)
        else:
            model = tiny_transformer(config)
            randomise_(model, seed + offset)
            state = _transformer_state(model.eval(), config)
        paths[name] = root / TINY_FILES[name]
        save_tensors_atomic(state, paths[name], metadata=_head_metadata(config))
    paths["clip_vision"] = root / TINY_FILES["clip_vision"]
    write_tiny_clip_vision(paths["clip_vision"])
    paths["vae22"] = write_tiny_vae22(root)
    return paths


def animate_state(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """A random Wan 2.2 Animate transformer in the released layout: the I2V names (proven through the key converter)
    and the Animate modules' released names. The motion encoder's weights are scaled at run time, so they are drawn
    at unit scale (as trained ones are): its output then varies with the face, as a real one's does."""
    from ..networks.wan_animate import ANIMATE_PREFIXES, WanAnimateTransformer, animate_released_name

    model = WanAnimateTransformer.from_config(config).eval()
    randomise_(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if name.startswith("motion_encoder.") and name.endswith("weight"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    state = model.state_dict()
    base = {name: tensor for name, tensor in state.items() if not name.startswith(ANIMATE_PREFIXES)}
    names = rename_map(original_transformer_names(config), convert_wan_transformer_keys)
    if set(names) != set(base):
        raise RuntimeError(f"original key layout does not round-trip: {sorted(set(names) ^ set(base))[:5]}")
    released = {original: base[name] for name, original in names.items()}
    released.update({animate_released_name(name): tensor for name, tensor in state.items()
                     if name.startswith(ANIMATE_PREFIXES)})
    return {name: tensor.detach().clone().contiguous() for name, tensor in released.items()}


def make_native_twins(root: Path, spiece_model: bytes, seed: int = SEED + 6) -> dict[str, Path]:
    """The models ComfyUI's own loaders read as well (``NATIVE_TRANSFORMER``, ``NATIVE_VACE``, ``NATIVE_UMT5``):
    a T2V transformer, a VACE transformer sharing its weights, and a umT5 of text width 4096."""
    paths = {name: root / TINY_FILES[name] for name in ("model_native", "vace_native", "text_encoder_native")}
    t2v = WanTransformer3DModel(**NATIVE_TRANSFORMER)
    randomise_(t2v, seed)
    vace = WanVACETransformer3DModel(**NATIVE_VACE)
    vace.load_state_dict(t2v.state_dict(), strict=False)
    randomise_(vace, seed + 1, only=lambda name: name.startswith("vace_"))
    heads = _head_metadata(NATIVE_TRANSFORMER)
    save_tensors_atomic(_transformer_state(t2v, NATIVE_TRANSFORMER), paths["model_native"], metadata=heads)
    save_tensors_atomic(_transformer_state(vace, NATIVE_VACE), paths["vace_native"], metadata=heads)
    vocab_size = sentencepiece.SentencePieceProcessor(model_proto=spiece_model).get_piece_size()
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=vocab_size, **NATIVE_UMT5))
    randomise_(text_encoder, seed + 2)
    save_tensors_atomic(original_text_encoder_state(text_encoder.eval(), spiece_model), paths["text_encoder_native"])
    return paths


def build_medium_transformer(seed: int = SEED + 5) -> WanTransformer3DModel:
    """The medium preset's T2V transformer (``MEDIUM_TRANSFORMER``) with seeded random weights."""
    model = WanTransformer3DModel(**MEDIUM_TRANSFORMER)
    randomise_(model, seed)
    return model.eval().requires_grad_(False)


def make_medium(directory: str | Path, progress: FileProgress | None = None) -> dict[str, Path]:
    """Write the medium preset under `directory` (``files.MEDIUM_FILES``): the medium T2V transformer in bf16,
    ComfyUI scaled fp8, Q8_0 and Q4_K GGUF (all made from the bf16 weights), and the tiny VAE and text encoder;
    returns the path of each."""
    root = Path(directory)
    paths = {name: root / relative for name, relative in MEDIUM_FILES.items()}
    float_state = _transformer_state(build_medium_transformer(), MEDIUM_TRANSFORMER)
    state = {key: tensor.to(torch.bfloat16) for key, tensor in float_state.items()}
    del float_state
    heads = _head_metadata(MEDIUM_TRANSFORMER)
    ggufs = {"t2v_gguf_q8_0": paths["model_gguf"], "t2v_gguf_q4_k": paths["model_gguf_q4_k"]}
    _write_all(root, [
        (paths["model"], lambda: save_tensors_atomic(state, paths["model"], metadata=heads)),
        (paths["model_fp8_scaled"], lambda: _write_scaled_fp8(state, paths["model_fp8_scaled"], heads)),
        (f"{paths['model_gguf'].relative_to(root)}, {paths['model_gguf_q4_k'].name}",
         lambda: _write_ggufs(state, ggufs, MEDIUM_TRANSFORMER["num_attention_heads"])),
        (f"{paths['vae'].relative_to(root)}, {paths['text_encoder'].relative_to(root)}",
         lambda: _write_vae_and_text_encoder(build_tiny_models(), paths)),
    ], progress)
    return paths


PRESETS = {"tiny": make_tiny, "medium": make_medium}


def make_models(directory: str | Path, preset: str = "tiny", progress: FileProgress | None = None) -> dict[str, Path]:
    """`wanmesh make-tiny DIR [--preset P]`: write preset ``preset``'s models under ``directory``, announcing each
    file to ``progress(n, N, what)``."""
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r} is unknown; valid: {', '.join(PRESETS)}")
    return PRESETS[preset](directory, progress)


def _write_loras(root: Path, t2v_state: dict[str, torch.Tensor]) -> dict[str, Path]:
    """The tiny LoRAs (one per format) for the tiny T2V model."""
    from .loras import make_tiny_loras

    shapes = {key: tuple(tensor.shape) for key, tensor in t2v_state.items()}
    names = rename_map([key for key in shapes if key.endswith(".weight")], convert_wan_transformer_to_diffusers)
    to_diffusers = {original.removesuffix(".weight"): new.removesuffix(".weight") for new, original in names.items()}
    return make_tiny_loras(root, shapes, to_diffusers)
