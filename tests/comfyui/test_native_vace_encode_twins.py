"""WanMesh VACE Encode beside native ``WanVaceToVideo`` (recent ComfyUI) on the tiny VAE file, edge cases included.

The native node runs in a subprocess inside the recent ComfyUI copy (its ``VAELoader`` path); WanMesh's node runs
here on a one-rank pool with the same file. For each case both get the same control video, masks and references,
and their VACE frames, masks and trim amounts must agree (1e-4 on the raw latents): two reference images (WanMesh's
default ``first`` equals native; ``all`` keeps both, beyond native, and differs), a control video shorter than
``length`` with masks longer than it, masks without a video, and a video longer than ``length`` with short masks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from wanmesh.nodes.bridge.runtime import ResidentModel
from wanmesh.nodes.vace import WanMeshVaceEncode
from wanmesh.parallel import ParallelConfig, PoolRunner
from wanmesh.parallel.driver.pool import close_cached_pool

WIDTH, HEIGHT, LENGTH = 32, 32, 9
TOLERANCE = 1e-4
CASES = {
    "two_references": dict(reference_image=(2, 40, 48)),
    "short_video_long_masks": dict(control_video=(3, 32, 32), control_masks=(12, 32, 32)),
    "masks_without_video": dict(control_masks=(5, 32, 32)),
    "long_video_short_masks": dict(control_video=(13, 40, 40), control_masks=(2, 40, 40), reference_image=(1, 32, 32)),
}

NATIVE = r"""
import sys
vae_file, io_file, width, height, length = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import torch, comfy.sd, comfy.utils
from comfy_extras.nodes_wan import WanVaceToVideo
from safetensors.torch import load_file, save_file
vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(vae_file))
inputs = load_file(io_file)
text = [[torch.zeros(1, 4, 64), {}]]
out = WanVaceToVideo.execute(text, text, vae, width, height, length, 1, 1.0, control_video=inputs.get("control_video"),
                             control_masks=inputs.get("control_masks"), reference_image=inputs.get("reference_image"))
positive, _, _, trim = out.args
save_file({"frames": positive[0][1]["vace_frames"][-1].contiguous(), "mask": positive[0][1]["vace_mask"][-1].contiguous(),
           "trim": torch.tensor([trim])}, io_file)
"""


def case_inputs(case: dict) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    made = {}
    for name, (frames, height, width) in case.items():
        if name == "control_masks":
            made[name] = (torch.rand(frames, height, width, generator=generator) > 0.5).float()
        else:
            made[name] = torch.rand(frames, height, width, 3, generator=generator)
    return made


@pytest.fixture(scope="module")
def vae(tiny_models_dir: Path):
    runner = PoolRunner.for_config(ParallelConfig(world=1, devices="cpu"), previews=False)
    path = tiny_models_dir / "vae" / "wan_tiny_vae.safetensors"
    yield path, ResidentModel(runner, runner.load_vae(str(path), dtype="fp32"))
    close_cached_pool()


def native_encode(comfy_dir: Path, vae_file: Path, inputs: dict, tmp_path: Path) -> dict[str, torch.Tensor]:
    io_file = tmp_path / "native_io.safetensors"
    save_file({name: tensor.contiguous() for name, tensor in inputs.items()} or {"none": torch.zeros(1)}, io_file)
    done = subprocess.run([sys.executable, "-c", NATIVE, str(vae_file), str(io_file), str(WIDTH), str(HEIGHT),
                           str(LENGTH)], cwd=comfy_dir, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(str(io_file))


def wanmesh_encode(vae_model, inputs: dict, reference_images: str = "first") -> dict[str, torch.Tensor]:
    text = [[torch.zeros(1, 4, 64), {}]]
    positive, _, _, trim = WanMeshVaceEncode().encode(text, text, vae_model, WIDTH, HEIGHT, LENGTH, 1, 1.0,
                                                      reference_images=reference_images, **inputs)
    return {"frames": positive[0][1]["vace_frames"][-1], "mask": positive[0][1]["vace_mask"][-1],
            "trim": torch.tensor([trim])}


def difference(a: dict, b: dict) -> float:
    assert a["frames"].shape == b["frames"].shape and a["mask"].shape == b["mask"].shape, (
        a["frames"].shape, b["frames"].shape, a["mask"].shape, b["mask"].shape)
    assert int(a["trim"]) == int(b["trim"])
    return max((a[k].float() - b[k].float()).abs().max().item() for k in ("frames", "mask"))


@pytest.mark.parametrize("name", list(CASES))
def test_vace_encode_equals_native_wan_vace_to_video(name, vae, recent_comfyui_dir, tmp_path) -> None:
    vae_file, vae_model = vae
    inputs = case_inputs(CASES[name])
    native = native_encode(recent_comfyui_dir, vae_file, inputs, tmp_path)
    ours = wanmesh_encode(vae_model, inputs)
    assert difference(native, ours) <= TOLERANCE, f"{name}: WanMesh VACE Encode differs from WanVaceToVideo"
    if name == "two_references":  # beyond native: every reference its own latent frame
        both = wanmesh_encode(vae_model, inputs, "all")
        assert int(both["trim"]) == 2 and both["frames"].shape[2] == ours["frames"].shape[2] + 1
        assert torch.allclose(both["frames"][:, :, 2:], ours["frames"][:, :, 1:], atol=TOLERANCE)
