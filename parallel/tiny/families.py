"""The transformers `wanmesh bench families` compares, one set per preset size (tiny, medium): a T2V model and, with
its width, depth and text width, Wan 2.2 Fun Control A14B (52 input channels, the reference image's ``ref_conv``),
Wan 2.1 Fun Camera (the I2V layout with 32 input channels and the camera adapter) and Wan 2.2 Animate (the I2V layout
with the pose embedding, the motion and face encoders and the face adapter); seeded random weights in the released
key layouts, written as the presets write theirs (``models.py``), and the tiny VAE the Fun Control conditioning is
encoded with; runs in the CLI process.

Animate's face adapter follows every fifth block (blocks 0, 5, ...: one adapter block per five blocks, as the
released model and ComfyUI's loader have it), so the set's depth is the preset's rounded up to a multiple of five
(tiny 4 -> 5 blocks, medium 8 -> 10), the same for all four. Animate's motion encoder and face encoder have the
released sizes whatever the transformer's (``networks/wan_animate.py``: 512x512 face frames).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import CLIP_VISION_WIDTH, LATENT_CHANNELS
from .files import TINY_FILES

FAMILIES = ("t2v", "fun22_control", "fun_camera", "animate")
FAMILY_NAMES = {"t2v": "T2V", "fun22_control": "Wan 2.2 Fun Control", "fun_camera": "Wan 2.1 Fun Camera",
                "animate": "Wan 2.2 Animate"}
SEED_OFFSETS = {"t2v": 40, "fun22_control": 41, "fun_camera": 42, "animate": 43}  # on the models' SEED
CAMERA_CHANNELS = 24  # the camera embedding's channels (Plücker rays of four frames per latent frame)


def family_configs(base: dict) -> dict[str, dict]:
    """Each family's transformer config on the preset's T2V config ``base`` (its depth rounded up to a multiple of
    Animate's face adapter period)."""
    from ..networks.wan_animate import FACE_ADAPTER_EVERY
    from ..weights.detect import REF_CONV_CHANNELS

    layers = math.ceil(base["num_layers"] / FACE_ADAPTER_EVERY) * FACE_ADAPTER_EVERY
    t2v = dict(base, num_layers=layers)
    inner = t2v["num_attention_heads"] * t2v["attention_head_dim"]
    i2v = dict(t2v, in_channels=2 * LATENT_CHANNELS + 4, image_dim=CLIP_VISION_WIDTH, added_kv_proj_dim=inner)
    return {"t2v": t2v,
            "fun22_control": dict(t2v, in_channels=3 * LATENT_CHANNELS + 4, **{REF_CONV_CHANNELS: LATENT_CHANNELS}),
            "fun_camera": dict(i2v, in_channels=2 * LATENT_CHANNELS, camera_in_channels=CAMERA_CHANNELS),
            "animate": i2v}


def preset_base(preset: str) -> tuple[dict, torch.dtype]:
    """The preset's T2V config and the dtype its files are stored in."""
    from .models import MEDIUM_TRANSFORMER, TINY_TRANSFORMER

    presets = {"tiny": (TINY_TRANSFORMER, torch.float32), "medium": (MEDIUM_TRANSFORMER, torch.bfloat16)}
    if preset not in presets:
        raise ValueError(f"preset {preset!r} is unknown; valid: {', '.join(presets)}")
    return presets[preset]


def family_file(preset: str, family: str) -> str:
    """A family's file in a models tree (relative)."""
    return f"diffusion_models/wan_{preset}_family_{family}.safetensors"


def ensure_family_files(directory: Path, preset: str, families: tuple[str, ...] = FAMILIES,
                        say: Callable[[str], None] = lambda line: None) -> dict[str, Path]:
    """The paths of the families' files (and ``vae``) under ``directory``, writing the ones missing (each announced
    to ``say``); later runs reuse them."""
    from ..tensor_files import save_tensors_atomic

    paths = {family: directory / family_file(preset, family) for family in families}
    paths["vae"] = directory / TINY_FILES["vae"]
    base, dtype = preset_base(preset)
    configs = family_configs(base)
    for name, path in paths.items():
        if not path.is_file():
            say(f"write {path}")
            state = _vae_state() if name == "vae" else _family_state(name, configs[name])
            metadata = None if name == "vae" else {"num_heads": str(configs[name]["num_attention_heads"])}
            dtype_of = torch.float32 if name == "vae" else dtype
            save_tensors_atomic({key: tensor.to(dtype_of) for key, tensor in state.items()}, path, metadata=metadata)
    return paths


def _family_state(family: str, config: dict) -> dict[str, torch.Tensor]:
    from .models import SEED, _transformer_state, animate_state, randomise_, tiny_transformer

    seed = SEED + SEED_OFFSETS[family]
    if family == "animate":
        return animate_state(config, seed)
    model = tiny_transformer(config)
    randomise_(model, seed)
    return _transformer_state(model.eval(), config)


def _vae_state() -> dict[str, torch.Tensor]:
    """The tiny VAE's weights in the released layout."""
    from .models import build_tiny_vae, original_vae_state

    return original_vae_state(build_tiny_vae())
