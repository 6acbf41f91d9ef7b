"""WanMesh's VAE decode and encode, and its transformer at odd latent sizes, beside the recent ComfyUI's native code
on the tiny model files.

The native side runs in a subprocess inside the recent ComfyUI copy (its ``VAELoader`` path: ``comfy.sd.VAE`` on the
file's state dict, then the ``VAEDecode`` / ``VAEDecodeTiled`` / ``VAEEncode`` node classes); the WanMesh side is one
rank's executor in this process. Both get the same latents and frames:

* whole-frame decode equals native ``VAEDecode`` (1e-4 in 0..1 pixels), also at an odd latent height;
* tiled decode is no further from the whole-frame decode than native ``VAEDecodeTiled`` is from native ``VAEDecode``
  at the same tile and overlap (tiles are blended raw and clamped once, as native does);
* an overlap above a quarter of the tile is lowered to a quarter, as ``VAEDecodeTiled`` lowers it: both sides decode
  such overlaps exactly as they decode a quarter-tile overlap, and WanMesh's tiles equal native's (1e-4);
* encoding a 10-frame video (not 4k+1) at a size that is not a multiple of 8 gives native ``VAEEncode``'s latent;
* the transformer on a latent of odd height and width (not a multiple of its 2x2 patches) gives native ``WanModel``'s
  prediction: both pad the latent to the patch grid the same way and crop the output back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from native_scripts import run_in_comfyui

TILE_PX, OVERLAP_PX = 64, 16  # native VAEDecodeTiled's smallest tile and a quarter-tile overlap
WIDE_OVERLAPS_PX = (32, 48)  # above a quarter of the tile (up to half was once taken as given), and above half
LATENT_SHAPE = (1, 16, 3, 13, 14)  # 104x112 px: 2x2 tiles of 64 px; odd latent height
ENCODE_FRAMES_SHAPE = (10, 44, 53, 3)  # 10 frames (native encodes 1 + 9 // 4 = 3 latent frames), 53x44 px
LATENT_TOLERANCE = 1e-4
PIXEL_TOLERANCE = 1e-4

NATIVE = r"""
import sys
vae_file, io_file, tile, overlap = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
wide_overlaps = [int(value) for value in sys.argv[5].split(",")]
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import comfy.sd, comfy.utils, nodes
from safetensors.torch import load_file, save_file
vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(vae_file))
inputs = load_file(io_file)
latent = {"samples": inputs["latents"]}
import torch
with torch.inference_mode():  # as ComfyUI's executor runs every node
    save_file({
        "decoded": nodes.VAEDecode().decode(vae, latent)[0].contiguous(),
        "tiled": nodes.VAEDecodeTiled().decode(vae, latent, tile, overlap, 4096, 8)[0].contiguous(),
        **{f"tiled_{wide}": nodes.VAEDecodeTiled().decode(vae, latent, tile, wide, 4096, 8)[0].contiguous()
           for wide in wide_overlaps},
        "encoded": nodes.VAEEncode().encode(vae, inputs["frames"])[0]["samples"].contiguous(),
    }, io_file)
"""


NATIVE_TRANSFORMER = r"""
import json, sys
model_file, io_file, sizes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import torch, comfy.ops, comfy.utils
from comfy.ldm.wan.model import WanModel
from safetensors.torch import load_file, save_file
# Built from the file's sizes: the loader's detection assumes umT5's 4096-wide text embeddings, the tiny model's are narrower.
model = WanModel(operations=comfy.ops.disable_weight_init, **sizes).eval()
missing, unexpected = model.load_state_dict(comfy.utils.load_torch_file(model_file), strict=False)
assert not unexpected and all(not key.startswith("blocks") for key in missing), (missing, unexpected)
inputs = load_file(io_file)
with torch.no_grad():
    out = model(inputs["latents"], inputs["timestep"], inputs["context"])
save_file({"prediction": out.float().contiguous()}, io_file)
"""
ODD_LATENT_SHAPE = (1, 16, 2, 5, 7)  # 56x40 px: odd latent height and width
PREDICTION_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {"latents": torch.randn(*LATENT_SHAPE, generator=generator),
            "frames": torch.rand(*ENCODE_FRAMES_SHAPE, generator=generator)}


@pytest.fixture(scope="module")
def vae_file(tiny_models_dir: Path) -> Path:
    return tiny_models_dir / "vae" / "wan_tiny_vae.safetensors"


@pytest.fixture(scope="module")
def native(recent_comfyui_dir: Path, vae_file: Path, inputs, tmp_path_factory) -> dict[str, torch.Tensor]:
    io_file = tmp_path_factory.mktemp("native_vae") / "io.safetensors"
    save_file(inputs, str(io_file))
    run_in_comfyui(NATIVE, recent_comfyui_dir, vae_file, io_file, TILE_PX, OVERLAP_PX,
                   ",".join(map(str, WIDE_OVERLAPS_PX)))
    return load_file(str(io_file))


@pytest.fixture(scope="module")
def wanmesh(vae_file: Path, inputs) -> dict[str, torch.Tensor]:
    from wanmesh.parallel.worker.executors import RankExecutor

    executor = RankExecutor("cpu")
    handle = executor.load_vae(str(vae_file), dtype="fp32")
    return {"decoded": executor.decode(handle, inputs["latents"]),
            "tiled": executor.decode(handle, inputs["latents"], tile_px=TILE_PX, overlap_px=OVERLAP_PX),
            **{f"tiled_{wide}": executor.decode(handle, inputs["latents"], tile_px=TILE_PX, overlap_px=wide)
               for wide in WIDE_OVERLAPS_PX},
            "encoded": executor.encode(handle, inputs["frames"])}


def _largest(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max())


def test_whole_frame_decode_equals_native_vae_decode(native, wanmesh) -> None:
    assert float(native["decoded"].std()) > 0.05  # the decode is not flat
    assert _largest(wanmesh["decoded"], native["decoded"]) <= PIXEL_TOLERANCE


def test_tiled_decode_is_no_further_from_whole_frames_than_native_tiling(native, wanmesh) -> None:
    native_drift = _largest(native["tiled"], native["decoded"])
    ours = _largest(wanmesh["tiled"], wanmesh["decoded"])
    assert native_drift > 0, "native tiling changed nothing: the latents are too small to be tiled"
    assert ours <= native_drift + PIXEL_TOLERANCE, f"WanMesh tiles drift {ours:.4f}, native tiles {native_drift:.4f}"


@pytest.mark.parametrize("wide", WIDE_OVERLAPS_PX)
def test_an_overlap_above_a_quarter_tile_is_lowered_as_native_vae_decode_tiled_lowers_it(native, wanmesh, wide):
    assert wide * 4 > TILE_PX == OVERLAP_PX * 4
    assert _largest(native[f"tiled_{wide}"], native["tiled"]) == 0.0  # native decodes it as a quarter-tile overlap
    assert _largest(wanmesh[f"tiled_{wide}"], wanmesh["tiled"]) == 0.0  # and so does WanMesh
    assert _largest(native[f"tiled_{wide}"], native["decoded"]) > 0.1  # the tiles show: another overlap would too
    assert _largest(wanmesh[f"tiled_{wide}"], native[f"tiled_{wide}"]) <= PIXEL_TOLERANCE


def test_encoding_ten_frames_of_an_odd_size_equals_native_vae_encode(native, wanmesh) -> None:
    assert native["encoded"].shape == (1, 16, 3, 44 // 8, 53 // 8)
    assert _largest(wanmesh["encoded"], native["encoded"]) <= LATENT_TOLERANCE


def test_transformer_on_an_odd_latent_size_equals_native_wan_model(recent_comfyui_dir, tiny_models_dir, tmp_path):
    from wanmesh.parallel.weights.loaders import load_transformer

    model_file = tiny_models_dir / "diffusion_models" / "wan_tiny_t2v.safetensors"
    model = load_transformer(str(model_file))
    generator = torch.Generator().manual_seed(3)
    inputs = {"latents": torch.randn(*ODD_LATENT_SHAPE, generator=generator), "timestep": torch.tensor([500.0]),
              "context": torch.randn(1, 8, model.config.text_dim, generator=generator)}
    with torch.no_grad():
        ours = model(hidden_states=inputs["latents"], timestep=inputs["timestep"],
                     encoder_hidden_states=inputs["context"], return_dict=False)[0]
    io_file = tmp_path / "io.safetensors"
    save_file(inputs, str(io_file))
    config = model.config
    sizes = {"dim": config.num_attention_heads * config.attention_head_dim, "ffn_dim": config.ffn_dim,
             "freq_dim": config.freq_dim, "text_dim": config.text_dim, "num_heads": config.num_attention_heads,
             "num_layers": config.num_layers, "eps": config.eps, "in_dim": config.in_channels,
             "out_dim": config.out_channels, "cross_attn_norm": config.cross_attn_norm}
    run_in_comfyui(NATIVE_TRANSFORMER, recent_comfyui_dir, model_file, io_file, json.dumps(sizes))
    native = load_file(str(io_file))["prediction"]
    assert ours.shape == native.shape == ODD_LATENT_SHAPE
    assert float(native.std()) > 0.05
    assert _largest(ours, native) <= PREDICTION_TOLERANCE
