"""The command line's camera motions (``parallel/camera_motion.py``) are native ``WanCameraEmbedding``'s output:
every preset, at several sizes, lengths and speeds, from the node itself run in the recent ComfyUI copy (a
subprocess inside it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from native_scripts import run_in_comfyui

from wanmesh.parallel.camera_motion import CAMERA_MOTIONS, camera_embedding

# (width, height, length, speed): wider and taller than the 16:9 pose aspect, one to four latent frames
CASES = [(48, 32, 9, 1.0), (32, 64, 13, 0.3), (112, 48, 5, 2.5), (16, 16, 1, 1.0)]

NATIVE = r"""
import json, sys
out_file, poses, cases = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
from comfy_extras.nodes_camera_trajectory import WanCameraEmbedding
from safetensors.torch import save_file
embeddings = {}
for name, pose in poses.items():
    for index, (width, height, length, speed) in enumerate(cases):
        output = WanCameraEmbedding.execute(pose, width, height, length, speed=speed)
        embeddings[f"{name}/{index}"] = output.result[0].float().contiguous()
save_file(embeddings, out_file)
"""


@pytest.fixture(scope="module")
def native(recent_comfyui_dir: Path, tmp_path_factory) -> dict[str, torch.Tensor]:
    out_file = tmp_path_factory.mktemp("camera_motion") / "native.safetensors"
    poses = {name: pose for name, (pose, _, _) in CAMERA_MOTIONS.items()}
    run_in_comfyui(NATIVE, recent_comfyui_dir, out_file, json.dumps(poses), json.dumps(CASES))
    return load_file(str(out_file))


@pytest.mark.parametrize("motion", CAMERA_MOTIONS)
def test_camera_motion_is_native_wan_camera_embedding(native, motion: str) -> None:
    for index, (width, height, length, speed) in enumerate(CASES):
        expected = native[f"{motion}/{index}"]
        ours = camera_embedding(motion, width, height, length, speed)
        assert ours.shape == expected.shape == (1, 24, (length - 1) // 4 + 1, height, width)
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    if motion != "static":  # the motion moves the rays
        assert (camera_embedding(motion, 48, 32, 9) - camera_embedding("static", 48, 32, 9)).abs().max() > 0.1
