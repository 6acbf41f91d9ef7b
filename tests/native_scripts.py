"""Source text shared by the scripts the ComfyUI tests run in ComfyUI's own interpreter (``python -c``, with the
ComfyUI copy as the working folder), so that each script reads as one piece and the common part is written once;
and ``run_in_comfyui``, which runs such a script."""

import subprocess
import sys
from pathlib import Path


def run_in_comfyui(script: str, comfy_dir: Path, *args, timeout_s: float = 600) -> None:
    """Run ``script`` (``python -c``) in the ComfyUI copy ``comfy_dir`` with ``args`` as its argv (as strings); a
    failure fails the test with the end of the script's standard error."""
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=comfy_dir, capture_output=True,
                          text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]

# Defines ``native_vae22(path)``: ComfyUI's VAE (``comfy.sd.VAE``, its detection, ratios and scaling) of a Wan 2.2
# VAE file at the file's own widths. comfy/sd.py builds every Wan 2.2 VAE at the release widths (160 / 256), so its
# class is given the file's widths for the load; every tensor of the file must fill a weight (strict load).
# Insert it after ``comfy.options.enable_args_parsing()``.
NATIVE_VAE22 = r"""
import comfy.ldm.wan.vae2_2 as _vae2_2, comfy.sd as _comfy_sd, comfy.utils as _comfy_utils


def native_vae22(path):
    sd = _comfy_utils.load_torch_file(path)
    widths = {"dim": sd["encoder.conv1.weight"].shape[0], "dec_dim": sd["decoder.head.0.gamma"].shape[0]}
    release_sized = _vae2_2.WanVAE
    _vae2_2.WanVAE = lambda **config: release_sized(**{**config, **widths})
    try:
        vae = _comfy_sd.VAE(sd=sd)
    finally:
        _vae2_2.WanVAE = release_sized
    assert isinstance(vae.first_stage_model, release_sized) and vae.latent_channels == 48, "not detected as Wan 2.2"
    vae.first_stage_model.load_state_dict(sd, strict=True)
    return vae
"""
