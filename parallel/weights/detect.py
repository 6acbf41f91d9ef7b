"""Recognising model files and inferring model configs from tensor shapes (never downloaded);
runs in the workers (and the driver, for header-only checks).

Keys here are in the ORIGINAL layouts users have as single files: Wan / VACE transformers
(`patch_embedding`, `blocks.N.self_attn.q`, ...), the Wan 2.1 VAE (`encoder.downsamples.N`, ...), the Wan 2.2 VAE
(`encoder.downsamples.L.downsamples.J`, ...: `vae22.py`) and
umT5 in transformers' T5 naming (`encoder.block.N.layer.0.SelfAttention.q`, ...). The configs returned
are keyword arguments for diffusers' / transformers' model classes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..config import IMAGE_CONCAT_CHANNELS, LATENT_CHANNELS, WAN22_LATENT_CHANNELS
from .checkpoint import COMFY_TRANSFORMER_PREFIX, ModelFileError, is_quantisation_key, read_safetensors_header

Shapes = Mapping[str, tuple[int, ...]]

WAN_HEAD_DIM = 128
VAE_LEVELS = 4
VAE_RES_BLOCKS = 2
UMT5_RELATIVE_MAX_DISTANCE = 128

KIND_DESCRIPTIONS = {
    "wan_t2v": "a Wan text-to-video transformer (keys patch_embedding, blocks.N.self_attn.*)",
    "wan_vace": "a full Wan VACE transformer (keys vace_blocks.*, vace_patch_embedding plus blocks.*)",
    "vace_module": "a VACE module (only vace_* keys; it needs a Wan T2V base model)",
    "wan_i2v": "a Wan image-to-video transformer (keys img_emb.*)",
    "diffusers_transformer": "a Wan transformer in diffusers key layout (keys condition_embedder.*, blocks.N.attn1.*)",
    "wan_vae": "a Wan VAE, 2.1 or 2.2 (keys encoder.*/decoder.*)",
    "diffusers_vae": "a Wan VAE in diffusers key layout (keys encoder.conv_in, decoder.up_blocks.*)",
    "umt5": "a umT5 text encoder (keys shared.weight, encoder.block.N.layer.*)",
    "clip_vision": "a CLIP vision encoder (keys visual.* / vision_model.*)",
    "wan_animate": "a Wan 2.2 Animate transformer (keys face_adapter.*, motion_encoder.*, pose_patch_embedding)",
    "wan_humo": "a HuMo transformer (keys audio_proj.*, blocks.N.audio_cross_attn_wrapper.*)",
    "unknown": "an unrecognised model",
}

# Wan 2.2 Animate: the I2V layout plus the face adapter (the key ComfyUI's model detection reads), the pose
# embedding and the face encoders; its config names this model class (``networks/wan_animate.py``).
ANIMATE_TELLTALE = "face_adapter."
ANIMATE_CLASS = "WanAnimateTransformer"
# HuMo: the Wan layout plus the audio projection (the key ComfyUI's model detection reads) and each block's audio
# cross-attention (``networks/wan_humo.py``, released names kept)
HUMO_TELLTALE = "audio_proj.audio_proj_glob_1."
HUMO_CLASS = "WanHumoTransformer3DModel"
HUMO_PREFIXES = ("audio_proj.",)
HUMO_BLOCK_PART = ".audio_cross_attn_wrapper."

# Wan families whose files WanMesh recognises but does not run yet: kind -> (family, the key that tells it, as
# ComfyUI's model detection reads it). A file of one of these is refused at load, naming its family.
UNSUPPORTED_FAMILIES = {
    "wan_s2v": ("Wan 2.2 Sound-to-video (S2V)", "casual_audio_encoder."),
    "wan_infinitetalk": ("InfiniteTalk / MultiTalk", ".audio_cross_attn."),
    "wan_dancer": ("WanDancer", "patch_embedding_global."),
    "wan_scail": ("SCAIL", "patch_embedding_pose."),
}
KIND_DESCRIPTIONS.update({kind: f"a {family} transformer (keys {key.strip('.')}.*)"
                          for kind, (family, key) in UNSUPPORTED_FAMILIES.items()})


def unsupported_family(keys: Iterable[str]) -> str | None:
    """The kind (a key of ``UNSUPPORTED_FAMILIES``) of a Wan variant WanMesh does not run yet, from its telltale
    keys (prefix ``model.diffusion_model.`` allowed); None for every other file."""
    names = [key.removeprefix(COMFY_TRANSFORMER_PREFIX) for key in keys]
    for kind, (_, telltale) in UNSUPPORTED_FAMILIES.items():
        if any(name.startswith(telltale) if not telltale.startswith(".") else telltale in name for name in names):
            return kind
    return None


def unsupported_family_error(location, kind: str) -> str:
    """The one-line refusal of a file of an unsupported Wan family."""
    family, telltale = UNSUPPORTED_FAMILIES[kind]
    return (f"{location} is a {family} model (keys {telltale.strip('.')}.*), a Wan variant WanMesh does not "
            "support yet; supported: T2V, I2V, FLF2V, TI2V 5B, Wan 2.2 A14B, VACE, Phantom, ATI, Fun InP / Control / "
            "Camera, Wan 2.2 Fun, Animate")


def detect_kind(keys: Iterable[str]) -> str:
    """Classify a checkpoint by its key names (prefix `model.diffusion_model.` allowed)."""
    names = {key.removeprefix(COMFY_TRANSFORMER_PREFIX) for key in keys if not is_quantisation_key(key)}
    if not names:
        return "unknown"
    if any(name.startswith(HUMO_TELLTALE) for name in names):  # before InfiniteTalk: both hold .audio_cross_attn.
        return "wan_humo"
    if (family := unsupported_family(names)) is not None:
        return family
    if any(name.startswith(ANIMATE_TELLTALE) for name in names):
        return "wan_animate"
    if any(name.startswith("img_emb.") for name in names):
        return "wan_i2v"
    if all(name.startswith("vace_") for name in names):
        return "vace_module"
    if "patch_embedding.weight" in names:
        return "wan_vace" if "vace_patch_embedding.weight" in names else "wan_t2v"
    if any(name.startswith("condition_embedder.") for name in names):
        return "diffusers_transformer"
    if "encoder.conv1.weight" in names and "decoder.conv1.weight" in names:
        return "wan_vae"
    if "encoder.conv_in.weight" in names and "decoder.conv_in.weight" in names:
        return "diffusers_vae"
    if any(name.startswith("encoder.block.") for name in names):
        return "umt5"
    if any(name.startswith(("visual.", "vision_model.")) for name in names):
        return "clip_vision"
    return "unknown"


@dataclass(frozen=True)
class FileHeader:
    """What a weight file says without reading any tensor: logical shapes, stored type names (safetensors' F32,
    F8_E4M3, ...; GGUF's Q8_0, ...) and metadata (``num_heads`` for a GGUF that carries its head count)."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    metadata: dict[str, str]


def read_header(path: str | Path) -> FileHeader:
    """The header of a safetensors file (its JSON header) or a GGUF file (its tensor index, after ``GGUFFile``'s
    checks: architecture, tensor types, latent channels); raises ``ModelFileError`` or ``OSError``."""
    if str(path).lower().endswith(".gguf"):
        from .gguf_file import GGUFFile  # the gguf package loads only when a GGUF file is read

        gguf = GGUFFile(path)
        try:
            return FileHeader(gguf.shapes(), {key: gguf.tensor_type(key).name for key in gguf.keys}, dict(gguf.metadata))
        finally:
            gguf.close()
    header = read_safetensors_header(path)
    metadata = header.pop("__metadata__", None) or {}
    return FileHeader({key: tuple(entry["shape"]) for key, entry in header.items()},
                      {key: entry["dtype"] for key, entry in header.items()}, metadata)


def safetensors_kind(path: str) -> str:
    """``detect_kind`` of a safetensors or GGUF file from its header alone (no tensor data is read); "unknown" for a
    file that cannot be read as either."""
    try:
        return detect_kind(read_header(path).shapes)
    except (OSError, ModelFileError):
        return "unknown"


def describe_kind(keys: Iterable[str]) -> str:
    return KIND_DESCRIPTIONS[detect_kind(keys)]


def _block_count(shapes: Shapes, prefix: str) -> int:
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)\.")
    indices = {int(match.group(1)) for key in shapes if (match := pattern.match(key))}
    return max(indices) + 1 if indices else 0


def _require(shapes: Shapes, key: str, what: str) -> tuple[int, ...]:
    if key not in shapes:
        raise ModelFileError(f"Cannot infer the {what}: tensor '{key}' is missing (found e.g. "
                             f"{', '.join(sorted(shapes)[:5])}).")
    return tuple(shapes[key])


def _head_count(dim: int, metadata: Mapping[str, str] | None) -> int:
    if metadata and "num_heads" in metadata:
        heads = int(metadata["num_heads"])
    elif dim % WAN_HEAD_DIM == 0:
        heads = dim // WAN_HEAD_DIM
    else:
        raise ModelFileError(
            f"Cannot infer the attention head count: hidden size {dim} is not a multiple of {WAN_HEAD_DIM} and "
            f"the file metadata has no 'num_heads'."
        )
    if heads <= 0 or dim % heads:
        raise ModelFileError(f"Metadata num_heads={heads} does not divide the hidden size {dim}.")
    return heads


def infer_transformer_config(shapes: Shapes, metadata: Mapping[str, str] | None) -> dict:
    """diffusers `WanTransformer3DModel` / `WanVACETransformer3DModel` kwargs from original-layout shapes.

    A `vace_layers` entry is present exactly when the shapes describe a VACE model; `image_dim` exactly when the
    model takes CLIP vision image tokens (Wan 2.1 I2V / FLF2V).
    """
    shapes = {key.removeprefix(COMFY_TRANSFORMER_PREFIX): tuple(shape) for key, shape in shapes.items()}
    dim, in_channels, *patch_size = _require(shapes, "patch_embedding.weight", "patch size")
    check_latent_channels(in_channels, camera=CAMERA_ADAPTER_KEY in shapes)
    num_layers = _block_count(shapes, "blocks.")
    if num_layers == 0:
        raise ModelFileError("Cannot infer the layer count: no 'blocks.N.*' tensors found.")
    head_out = _require(shapes, "head.head.weight", "output channels")[0]
    patch_volume = patch_size[0] * patch_size[1] * patch_size[2]
    heads = _head_count(dim, metadata)
    config = {
        "patch_size": tuple(patch_size),
        "num_attention_heads": heads,
        "attention_head_dim": dim // heads,
        "in_channels": in_channels,
        "out_channels": head_out // patch_volume,
        "text_dim": _require(shapes, "text_embedding.0.weight", "text dim")[1],
        "freq_dim": _require(shapes, "time_embedding.0.weight", "frequency dim")[1],
        "ffn_dim": _require(shapes, "blocks.0.ffn.0.weight", "FFN dim")[0],
        "num_layers": num_layers,
        "cross_attn_norm": "blocks.0.norm3.weight" in shapes,
        "qk_norm": "rms_norm_across_heads" if "blocks.0.self_attn.norm_q.weight" in shapes else None,
        "eps": 1e-6,
    }
    config.update(_image_embedding_config(shapes))
    if "ref_conv.weight" in shapes:  # Wan 2.2 Fun: the reference image's embedding (networks/reference.py)
        config[REF_CONV_CHANNELS] = shapes["ref_conv.weight"][1]
    if any(key.startswith(ANIMATE_TELLTALE) for key in shapes):
        config["_class_name"] = ANIMATE_CLASS
    if any(key.startswith(HUMO_TELLTALE) for key in shapes):
        if in_channels != WAN21_LATENT_CHANNELS:  # 17B: ComfyUI's fixed zero-VAE image channels, not here yet
            raise ModelFileError(f"This HuMo transformer takes {in_channels} input channels (HuMo 17B), which is not "
                                 f"supported yet; supported: HuMo 1.7B ({WAN21_LATENT_CHANNELS} input channels)")
        config["_class_name"] = HUMO_CLASS
    config.update(_camera_config(shapes))
    vace_count = _block_count(shapes, "vace_blocks.")
    if vace_count:
        config["vace_layers"] = [i * num_layers // vace_count for i in range(vace_count)]
        config["vace_in_channels"] = _require(shapes, "vace_patch_embedding.weight", "VACE input channels")[1]
    return config


def _image_embedding_config(shapes: Shapes) -> dict:
    """The image-token part of the config (diffusers' names): CLIP feature width, the image cross-attention's
    input width and, for first-last-frame models, the learned position embedding's length (two images' tokens)."""
    if "img_emb.proj.0.weight" not in shapes:
        return {}
    config = {"image_dim": shapes["img_emb.proj.0.weight"][0],
              "added_kv_proj_dim": _require(shapes, "blocks.0.cross_attn.k_img.weight", "image key width")[1]}
    if "img_emb.emb_pos" in shapes:
        config["pos_embed_seq_len"] = shapes["img_emb.emb_pos"][1]
    return config


CAMERA_ADAPTER_KEY = "control_adapter.conv.weight"  # Wan Fun Camera, as ComfyUI's model detection tells it
CAMERA_PIXEL_FOLD = 8 * 8  # the camera adapter pixel-unshuffles 8x8 pixels into its convolution's input channels


def _camera_config(shapes: Shapes) -> dict:
    """A Fun Camera model's camera embedding channels (its adapter's input width over the 8x8 pixel fold)."""
    if CAMERA_ADAPTER_KEY not in shapes:
        return {}
    return {"camera_in_channels": shapes[CAMERA_ADAPTER_KEY][1] // CAMERA_PIXEL_FOLD}


WAN21_LATENT_CHANNELS = LATENT_CHANNELS
WAN22_TI2V_LATENT_CHANNELS = WAN22_LATENT_CHANNELS
I2V_IN_CHANNELS = WAN21_LATENT_CHANNELS + IMAGE_CONCAT_CHANNELS
# Wan 2.1 Fun Control: the noise, then the control video's and the start image's latents (16 channels each)
FUN_CONTROL_IN_CHANNELS = 3 * WAN21_LATENT_CHANNELS
# Wan 2.2 Fun Control A14B: the noise, the control video's latents, the 4-channel mask, the start image's latents
FUN22_CONTROL_IN_CHANNELS = FUN_CONTROL_IN_CHANNELS + I2V_IN_CHANNELS - WAN21_LATENT_CHANNELS - WAN21_LATENT_CHANNELS
# Wan 2.2 Fun 5B on the 48-channel latent: the noise, the control (or start) latents and the mask, and the start
# latents after them where the model takes both (ComfyUI's concat_cond fills either from Wan22FunControlToVideo)
FUN22_5B_IN_CHANNELS = (2 * WAN22_TI2V_LATENT_CHANNELS + 4, 3 * WAN22_TI2V_LATENT_CHANNELS + 4)
TRANSFORMER_IN_CHANNELS = (WAN21_LATENT_CHANNELS, I2V_IN_CHANNELS, WAN22_TI2V_LATENT_CHANNELS,
                           FUN22_CONTROL_IN_CHANNELS, *FUN22_5B_IN_CHANNELS)
# The config entry (not a diffusers one) of a model with a reference-image convolution: its input channels.
REF_CONV_CHANNELS = "ref_conv_in_channels"
# Wan 2.1 Fun Camera: the noise and the start image's latents (no mask), beside its camera adapter; Wan 2.2 Fun
# Camera A14B: the image-to-video channels (noise, mask, start latents), beside the same adapter
FUN_CAMERA_IN_CHANNELS = 2 * WAN21_LATENT_CHANNELS
FUN22_CAMERA_IN_CHANNELS = I2V_IN_CHANNELS


def check_latent_channels(in_channels: int, camera: bool = False) -> None:
    """Transformers on the 16-channel Wan 2.1 latent load: text-to-video and VACE (16 input channels),
    image-to-video (36: Wan 2.1 I2V / FLF2V / Fun InP, both Wan 2.2 I2V A14B experts, Wan 2.2 Fun InP A14B), Wan 2.1
    Fun Control (48: control and start-image latents) and Wan 2.2 Fun Control A14B (52: control latents, mask,
    start-image latents); so do Wan 2.2 TI2V 5B on the 48-channel Wan 2.2 latent (text- and
    image-to-video: the start image is in the latent) and Wan 2.2 Fun 5B (100 or 148: its conditioning latents and
    mask concatenated); Wan 2.1 Fun Camera (32: the start image's latents) and Wan 2.2 Fun Camera A14B (36: the
    mask and the start image's latents) when the file has its camera adapter."""
    if camera:
        if in_channels not in (FUN_CAMERA_IN_CHANNELS, FUN22_CAMERA_IN_CHANNELS):
            raise ModelFileError(f"This Fun Camera transformer takes {in_channels} input channels, which is not "
                                 f"supported; supported: Wan 2.1 Fun Camera ({FUN_CAMERA_IN_CHANNELS} input channels) "
                                 f"and Wan 2.2 Fun Camera ({FUN22_CAMERA_IN_CHANNELS})")
        return
    if in_channels not in TRANSFORMER_IN_CHANNELS:
        raise ModelFileError(
            f"This transformer takes {in_channels} input channels, which is "
            f"not supported; supported: {WAN21_LATENT_CHANNELS} (T2V, VACE), {I2V_IN_CHANNELS} (image-to-video, "
            f"Fun InP), {FUN_CONTROL_IN_CHANNELS} (Fun Control, Wan 2.2 TI2V 5B), {FUN22_CONTROL_IN_CHANNELS} (Wan 2.2 "
            f"Fun A14B), {' or '.join(map(str, FUN22_5B_IN_CHANNELS))} (Wan 2.2 Fun 5B), {FUN_CAMERA_IN_CHANNELS} with a "
            "camera adapter (Wan 2.1 Fun Camera).")


def image_inputs(config: Mapping) -> str | None:
    """What image conditioning a transformer config takes: "fun_control" (Wan 2.1 Fun Control: the control video's
    and start image's latents, CLIP vision tokens when it has an image embedding; Wan 2.2 Fun Control A14B: the same
    with a mask between them, and a reference image when it has a ``ref_conv``), "first_last" (Wan 2.1 FLF2V: two
    images' tokens), "clip_vision" (Wan 2.1 I2V and Fun InP: latents of the start image and CLIP vision tokens),
    "latents" (Wan 2.2 I2V A14B: image latents only), "camera" (Wan 2.1 Fun Camera: start image latents, CLIP vision
    tokens and the camera embedding), "first_frame" (Wan 2.2 TI2V 5B: text-to-video, or
    image-to-video with the start image's latents kept in the latent by a noise mask; Wan 2.2 Fun 5B: Wan22FunControlToVideo's
    concatenated latents), "animate" (Wan 2.2 Animate: the I2V inputs plus pose latents and a face video), or None
    (text-to-video and VACE)."""
    if config.get("_class_name") == ANIMATE_CLASS:
        return "animate"
    if config.get("_class_name") == HUMO_CLASS:
        return "humo"
    in_channels = config.get("in_channels", WAN21_LATENT_CHANNELS)
    out_channels = config.get("out_channels", WAN21_LATENT_CHANNELS)
    if out_channels == WAN22_TI2V_LATENT_CHANNELS:
        return "first_frame"
    if config.get("camera_in_channels"):
        return "camera"
    if in_channels in (FUN_CONTROL_IN_CHANNELS, FUN22_CONTROL_IN_CHANNELS):
        return "fun_control"
    if config.get("pos_embed_seq_len"):
        return "first_last"
    if config.get("image_dim"):
        return "clip_vision"
    if in_channels == I2V_IN_CHANNELS:
        return "latents"
    return None


def infer_vae_config(shapes: Shapes) -> dict:
    """diffusers `AutoencoderKLWan` kwargs from original-layout VAE shapes (unprefixed keys): the Wan 2.2 VAE (48
    latent channels, nested levels; ``vae22.py``) or the Wan 2.1 VAE (16 channels, one flat block sequence)."""
    from .vae22_keys import infer_wan22_vae_config, is_wan22_vae  # here: this module loads at ComfyUI start-up

    if is_wan22_vae(shapes):
        return infer_wan22_vae_config(shapes)
    return _infer_wan21_vae_config(shapes)


def _infer_wan21_vae_config(shapes: Shapes) -> dict:
    base_dim = _require(shapes, "encoder.conv1.weight", "VAE base dim")[0]
    z_dim = _require(shapes, "conv2.weight", "VAE latent channels")[0]
    if z_dim != WAN21_LATENT_CHANNELS:
        raise ModelFileError(f"This VAE has {z_dim} latent channels in the Wan 2.1 key layout, which is not "
                             f"supported; use the Wan 2.1 VAE ({WAN21_LATENT_CHANNELS} channels, also used by Wan 2.2 "
                             f"A14B) or the Wan 2.2 VAE ({WAN22_TI2V_LATENT_CHANNELS} channels, "
                             f"wan2.2_vae.safetensors).")
    # diffusers' key converter is written for 4 levels of 2 residual blocks with resamples between them.
    resample_indices = [level * (VAE_RES_BLOCKS + 1) + VAE_RES_BLOCKS for level in range(VAE_LEVELS - 1)]
    expected_blocks = VAE_LEVELS * VAE_RES_BLOCKS + VAE_LEVELS - 1
    found_blocks = _block_count(shapes, "encoder.downsamples.")
    if found_blocks != expected_blocks or any(".to_qkv." in key for key in shapes if ".downsamples." in key):
        raise ModelFileError(
            f"Unsupported VAE layout: expected the Wan 2.1 VAE ({VAE_LEVELS} levels x {VAE_RES_BLOCKS} residual "
            f"blocks = {expected_blocks} encoder.downsamples entries, no attention), found {found_blocks} entries."
        )
    first_resnets = [level * (VAE_RES_BLOCKS + 1) for level in range(VAE_LEVELS)]
    dim_mult = [shapes[f"encoder.downsamples.{index}.residual.2.weight"][0] // base_dim for index in first_resnets]
    return {
        "base_dim": base_dim,
        "z_dim": z_dim,
        "dim_mult": dim_mult,
        "num_res_blocks": VAE_RES_BLOCKS,
        "attn_scales": [],
        "temperal_downsample": [f"encoder.downsamples.{i}.time_conv.weight" in shapes for i in resample_indices],
    }


def infer_umt5_config(shapes: Shapes) -> dict:
    """transformers `UMT5Config` kwargs from umT5 encoder shapes (transformers T5 naming)."""
    embedding_key = "shared.weight" if "shared.weight" in shapes else "encoder.embed_tokens.weight"
    vocab_size, d_model = _require(shapes, embedding_key, "vocabulary size")
    num_layers = _block_count(shapes, "encoder.block.")
    layer0 = "encoder.block.0.layer."
    buckets, num_heads = _require(shapes, f"{layer0}0.SelfAttention.relative_attention_bias.weight", "head count")
    inner_dim = _require(shapes, f"{layer0}0.SelfAttention.q.weight", "attention size")[0]
    gated = f"{layer0}1.DenseReluDense.wi_0.weight" in shapes
    d_ff = _require(shapes, f"{layer0}1.DenseReluDense.{'wi_0' if gated else 'wi'}.weight", "FFN size")[0]
    return {
        "vocab_size": vocab_size,
        "d_model": d_model,
        "d_kv": inner_dim // num_heads,
        "d_ff": d_ff,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "relative_attention_num_buckets": buckets,
        "relative_attention_max_distance": UMT5_RELATIVE_MAX_DISTANCE,
        "feed_forward_proj": "gated-gelu" if gated else "relu",
        "dropout_rate": 0.0,
        "layer_norm_epsilon": 1e-6,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
        "is_encoder_decoder": False,
        "use_cache": False,
    }
