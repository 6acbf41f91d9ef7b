"""Where the tiny built-in models live on disk; light (no model libraries), used by the CLI and benchmarks."""

from __future__ import annotations

from pathlib import Path

from ..config import cache_root

TINY_FILES = {
    "model": "diffusion_models/wan_tiny_t2v.safetensors",
    "vace": "diffusion_models/wan_tiny_vace.safetensors",
    "vae": "vae/wan_tiny_vae.safetensors",
    "text_encoder": "text_encoders/umt5_tiny.safetensors",
    "model_gguf": "diffusion_models/wan_tiny_t2v_Q8_0.gguf",
    **{f"lora_{name}": f"loras/wan_tiny_lora_{name}.safetensors" for name in ("comfy", "peft", "kohya", "diff")},
    "model_low": "diffusion_models/wan_tiny_t2v_low.safetensors",  # the tiny low-noise expert (two-expert runs)
    "model_fp8_scaled": "diffusion_models/wan_tiny_t2v_fp8_scaled.safetensors",  # ComfyUI scaled fp8
    # Native twins: shapes ComfyUI's own Wan loader reads (heads of 128, text width 4096), with their text encoder
    "model_native": "diffusion_models/wan_native_t2v.safetensors",
    "vace_native": "diffusion_models/wan_native_vace.safetensors",
    "text_encoder_native": "text_encoders/umt5_native.safetensors",
    # Image-to-video (native-loadable; text from the native umT5 twin): Wan 2.1 I2V and FLF2V with the tiny CLIP
    # vision encoder, the Wan 2.2 I2V A14B-like expert pair
    "i2v": "diffusion_models/wan_tiny_i2v.safetensors",
    "flf2v": "diffusion_models/wan_tiny_flf2v.safetensors",
    "i2v_high": "diffusion_models/wan22_tiny_i2v_high.safetensors",
    "i2v_low": "diffusion_models/wan22_tiny_i2v_low.safetensors",
    "ti2v": "diffusion_models/wan22_tiny_ti2v.safetensors",  # Wan 2.2 TI2V 5B-like: 48-channel latents
    "fun_inp": "diffusion_models/wan_tiny_fun_inp.safetensors",  # Wan 2.1 Fun InP-like (the I2V layout)
    "fun_control": "diffusion_models/wan_tiny_fun_control.safetensors",  # Wan 2.1 Fun Control-like: 48 channels in
    "vae22": "vae/wan22_tiny_vae.safetensors",  # its tiny Wan 2.2 VAE (48 channels; tiny/vae22.py writes it)
    "clip_vision": "clip_vision/clip_vision_tiny.safetensors",
    # Wan 2.2 Fun Control A14B-like: 52 channels in (control latents, mask, start latents), a reference ref_conv
    "fun22_control": "diffusion_models/wan22_tiny_fun_control.safetensors",
    # Wan 2.2 Fun 5B Control-like: 48-channel latents, 148 channels in (control, mask, start), a 48-channel ref_conv
    "fun22_5b_control": "diffusion_models/wan22_tiny_fun_5b_control.safetensors",
    "animate": "diffusion_models/wan22_tiny_animate.safetensors",  # Wan 2.2 Animate-like (the I2V layout + face/pose)
    "fun_camera": "diffusion_models/wan_tiny_fun_camera.safetensors",  # Wan 2.1 Fun Camera-like: camera adapter
    # Wan 2.2 Fun Camera A14B-like: the I2V expert layout (36 channels in, no image tokens) and the camera adapter
    "fun22_camera": "diffusion_models/wan22_tiny_fun_camera.safetensors",
}

# `wanmesh make-tiny DIR --preset medium`: a ~150M-parameter T2V transformer in the formats users have, with the
# tiny VAE and text encoder beside it (the medium model's text dim is the tiny umT5's).
MEDIUM_FILES = {
    "model": "diffusion_models/wan_medium_t2v.safetensors",
    "model_fp8_scaled": "diffusion_models/wan_medium_t2v_fp8_scaled.safetensors",
    "model_gguf": "diffusion_models/wan_medium_t2v_Q8_0.gguf",
    "model_gguf_q4_k": "diffusion_models/wan_medium_t2v_Q4_K.gguf",
    "vae": TINY_FILES["vae"],
    "text_encoder": TINY_FILES["text_encoder"],
}


def tiny_cache_dir() -> Path:
    return cache_root() / "tiny-models"


def ensure_tiny_models(directory: Path) -> Path:
    """Write the tiny models once; later runs reuse them."""
    from .models import make_tiny

    if not all((directory / rel).is_file() for rel in TINY_FILES.values()):
        make_tiny(directory)
    return directory
