"""WanMesh's Wan 2.2 VAE (48 latent channels, 16x spatial) beside the recent ComfyUI's native code on the tiny file.

The native side runs in a subprocess inside the recent ComfyUI copy: ``comfy.sd.VAE`` on the file's state dict (its
Wan 2.2 detection, ratios, crop and pixel scaling, ``comfy/ldm/wan/vae2_2.py``'s model), then the ``VAEDecode`` /
``VAEDecodeTiled`` / ``VAEEncode`` node classes. ComfyUI builds every Wan 2.2 VAE at the release widths (encoder 160,
decoder 256: a 2.8 GB model), so the subprocess builds its model at the widths the tiny file holds and checks that
the file fills that model exactly; everything else is ComfyUI's as shipped. The WanMesh side is one rank's executor
in this process. Both get the same latents and frames:

* whole-frame decode equals native ``VAEDecode`` (1e-4 in 0..1 pixels) at an odd latent height;
* tiled decode (64 px tiles, 16 px overlap) equals native ``VAEDecodeTiled`` at the same tile and overlap (1e-4), and
  so is no further from the whole-frame decode than native tiling is;
* encoding 7 frames (not 4k+1) of 53x44 px (not multiples of 16) gives native ``VAEEncode``'s latent (1e-4);
* the 48 latent statistics are ComfyUI's ``latent_formats.Wan22``'s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from native_scripts import NATIVE_VAE22, run_in_comfyui

TILE_PX, OVERLAP_PX = 64, 16  # native VAEDecodeTiled's smallest tile: 4 latents, overlap 1 latent at 16 px a latent
LATENT_SHAPE = (1, 48, 2, 5, 6)  # 80x96 px, 5 frames: 2x2 tiles of 64 px; odd latent height
ENCODE_FRAMES_SHAPE = (7, 53, 44, 3)  # 7 frames (native encodes 1 + 6 // 4 = 2 latent frames), 44x53 px
LATENT_TOLERANCE = 1e-4
PIXEL_TOLERANCE = 1e-4

NATIVE = r"""
import sys
vae_file, io_file, tile, overlap = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
""" + NATIVE_VAE22 + r"""
import torch, comfy.latent_formats, nodes
from safetensors.torch import load_file, save_file
vae = native_vae22(vae_file)  # every tensor of the file is a weight, none is missing
assert (vae.spacial_compression_decode(), vae.spacial_compression_encode()) == (16, 16)
assert vae.vae_dtype == torch.float32, vae.vae_dtype
inputs = load_file(io_file)
latent = {"samples": inputs["latents"]}
stats = comfy.latent_formats.Wan22()
import torch
with torch.inference_mode():  # as ComfyUI's executor runs every node
    save_file({
        "decoded": nodes.VAEDecode().decode(vae, latent)[0].contiguous(),
        "tiled": nodes.VAEDecodeTiled().decode(vae, latent, tile, overlap, 4096, 8)[0].contiguous(),
        "encoded": nodes.VAEEncode().encode(vae, inputs["frames"])[0]["samples"].contiguous(),
        "latents_mean": stats.latents_mean.flatten().contiguous(),
        "latents_std": stats.latents_std.flatten().contiguous(),
    }, io_file)
"""


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(8)
    return {"latents": torch.randn(*LATENT_SHAPE, generator=generator),
            "frames": torch.rand(*ENCODE_FRAMES_SHAPE, generator=generator)}


@pytest.fixture(scope="module")
def vae_file(tmp_path_factory) -> Path:
    from wanmesh.parallel.tiny.vae22 import write_tiny_vae22

    return write_tiny_vae22(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def native(recent_comfyui_dir: Path, vae_file: Path, inputs, tmp_path_factory) -> dict[str, torch.Tensor]:
    io_file = tmp_path_factory.mktemp("native_vae22") / "io.safetensors"
    save_file(inputs, str(io_file))
    run_in_comfyui(NATIVE, recent_comfyui_dir, vae_file, io_file, TILE_PX, OVERLAP_PX, timeout_s=300)
    return load_file(str(io_file))


@pytest.fixture(scope="module")
def wanmesh(vae_file: Path, inputs) -> dict[str, torch.Tensor]:
    from wanmesh.parallel.worker.executors import RankExecutor

    executor = RankExecutor("cpu")
    handle = executor.load_vae(str(vae_file), dtype="fp32")
    return {"decoded": executor.decode(handle, inputs["latents"]),
            "tiled": executor.decode(handle, inputs["latents"], tile_px=TILE_PX, overlap_px=OVERLAP_PX),
            "encoded": executor.encode(handle, inputs["frames"])}


def _largest(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max())


def test_whole_frame_decode_equals_native_vae_decode(native, wanmesh) -> None:
    assert native["decoded"].shape == (5, 80, 96, 3)
    assert float(native["decoded"].std()) > 0.05  # the decode is not flat
    assert _largest(wanmesh["decoded"], native["decoded"]) <= PIXEL_TOLERANCE


def test_tiled_decode_is_no_further_from_whole_frames_than_native_tiling(native, wanmesh) -> None:
    native_drift = _largest(native["tiled"], native["decoded"])
    ours = _largest(wanmesh["tiled"], wanmesh["decoded"])
    assert native_drift > 0, "native tiling changed nothing: the latents are too small to be tiled"
    assert ours <= native_drift + PIXEL_TOLERANCE, f"WanMesh tiles drift {ours:.4f}, native tiles {native_drift:.4f}"


def test_tiled_decode_equals_native_vae_decode_tiled(native, wanmesh) -> None:
    assert _largest(wanmesh["tiled"], native["tiled"]) <= PIXEL_TOLERANCE  # the same tiles, blended the same way


def test_encoding_seven_frames_of_an_odd_size_equals_native_vae_encode(native, wanmesh) -> None:
    assert native["encoded"].shape == (1, 48, 2, 53 // 16, 44 // 16)
    assert float(native["encoded"].std()) > 0.05
    assert _largest(wanmesh["encoded"], native["encoded"]) <= LATENT_TOLERANCE


def test_latent_statistics_are_comfyui_wan22s(native) -> None:
    from wanmesh.parallel.weights.vae22_keys import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD

    assert torch.equal(native["latents_mean"], torch.tensor(WAN22_LATENTS_MEAN))
    assert torch.equal(native["latents_std"], torch.tensor(WAN22_LATENTS_STD))
