"""The Fun Camera embedding of a preset camera motion, as native ComfyUI's ``WanCameraEmbedding`` makes it; light
(numpy and torch), used by the command line (``wanmesh generate --camera-motion``) in the driver's process.

A motion is a rotation rate (x, y, z, times 60 degrees) and a translation rate (times 1.5) reached over the video:
frame i of n has the camera pose ``[R(a i/n) | t i/n]``. Each frame's camera rays are Plücker coordinates
(the ray's moment ``o x d`` and its direction ``d``, six channels per pixel) for intrinsics fx, fy, cx, cy given as
fractions of the frame, fitted from a 1280x720 pose aspect to the video's as the native node fits them. The first
frame is repeated to fill its latent frame (the VAE's first latent frame is one frame), then each four frames' six
channels fold into the 24 channels of one latent frame: [1, 24, latent frames, height, width]. Written here
because the native node is ComfyUI code (which ``parallel/`` never imports); the tests check it against the node.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .config import TEMPORAL_STRIDE

# name on the command line -> (ComfyUI's pose name, rotation rate about x, y, z, translation rate along x, y, z)
CAMERA_MOTIONS = {
    "static": ("Static", (0.0, 0.0, 0.0), (0.0, 0.0, 0.0)),
    "pan-up": ("Pan Up", (0.0, 0.0, 0.0), (0.0, -1.0, 0.0)),
    "pan-down": ("Pan Down", (0.0, 0.0, 0.0), (0.0, 1.0, 0.0)),
    "pan-left": ("Pan Left", (0.0, 0.0, 0.0), (-1.0, 0.0, 0.0)),
    "pan-right": ("Pan Right", (0.0, 0.0, 0.0), (1.0, 0.0, 0.0)),
    "zoom-in": ("Zoom In", (0.0, 0.0, 0.0), (0.0, 0.0, 2.0)),
    "zoom-out": ("Zoom Out", (0.0, 0.0, 0.0), (0.0, 0.0, -2.0)),
    "anti-clockwise": ("Anti Clockwise (ACW)", (0.0, 0.0, -1.0), (0.0, 0.0, 0.0)),
    "clockwise": ("ClockWise (CW)", (0.0, 0.0, 1.0), (0.0, 0.0, 0.0)),
}
ROTATION_UNIT = math.pi / 3  # a rotation rate of 1 turns the camera 60 degrees over the video
TRANSLATION_UNIT = 1.5
POSE_WIDTH, POSE_HEIGHT = 1280, 720  # the aspect the intrinsics are given for
PLUCKER_CHANNELS = 6


def _rotation(angles: np.ndarray) -> np.ndarray:
    """Rz @ Ry @ Rx for angles (x, y, z) in radians."""
    (cx, cy, cz), (sx, sy, sz) = np.cos(angles), np.sin(angles)
    rx = np.array([[1, 0, 0], [0, cx, -sx], [0, sx, cx]])
    ry = np.array([[cy, 0, sy], [0, 1, 0], [-sy, 0, cy]])
    rz = np.array([[cz, -sz, 0], [sz, cz, 0], [0, 0, 1]])
    return rz @ (ry @ rx)


def camera_poses(motion: str, frames: int, speed: float = 1.0) -> np.ndarray:
    """Camera-to-world matrices [frames, 4, 4] (float64) of a motion, relative to the first frame's camera."""
    _, rotation, translation = CAMERA_MOTIONS[motion]
    poses = np.tile(np.eye(4), (frames, 1, 1))
    for index in range(frames):
        progress = index / frames * speed
        poses[index, :3, :3] = _rotation(progress * ROTATION_UNIT * np.array(rotation))
        poses[index, :3, 3] = progress * TRANSLATION_UNIT * np.array(translation)
    return np.linalg.inv(poses[0]) @ poses


def _intrinsics(width: int, height: int, fx: float, fy: float, cx: float, cy: float) -> torch.Tensor:
    """(fx, fy, cx, cy) in pixels, the focal length fitted from the pose aspect to the video's."""
    pose_aspect, aspect = POSE_WIDTH / POSE_HEIGHT, width / height
    if pose_aspect > aspect:
        fx = height * pose_aspect * fx / width
    else:
        fy = width / pose_aspect * fy / height
    return torch.tensor([fx * width, fy * height, cx * width, cy * height], dtype=torch.float32)


def plucker_rays(poses: torch.Tensor, intrinsics: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Plücker coordinates [frames, height, width, 6] (moment o x d, then direction d) of each pixel centre's ray."""
    rows = torch.linspace(0, height - 1, height, dtype=poses.dtype)
    columns = torch.linspace(0, width - 1, width, dtype=poses.dtype)
    y, x = torch.meshgrid(rows, columns, indexing="ij")
    fx, fy, cx, cy = intrinsics
    x, y = x.reshape(1, -1) + 0.5, y.reshape(1, -1) + 0.5
    directions = torch.stack(((x - cx) / fx, (y - cy) / fy, torch.ones_like(x)), dim=-1)
    directions = directions / directions.norm(dim=-1, keepdim=True)
    rays = directions @ poses[:, :3, :3].transpose(-1, -2)  # [frames, pixels, 3]
    origins = poses[:, None, :3, 3].expand_as(rays)
    plucker = torch.cat([torch.linalg.cross(origins, rays, dim=-1), rays], dim=-1)
    return plucker.reshape(poses.shape[0], height, width, PLUCKER_CHANNELS)


def camera_embedding(motion: str, width: int, height: int, length: int, speed: float = 1.0, fx: float = 0.5,
                     fy: float = 0.5, cx: float = 0.5, cy: float = 0.5) -> torch.Tensor:
    """WanCameraEmbedding's output for a preset motion: [1, 24, latent frames, height, width] (float32)."""
    poses = torch.as_tensor(camera_poses(motion, length, speed), dtype=torch.float32)
    rays = plucker_rays(poses, _intrinsics(width, height, fx, fy, cx, cy), width, height)  # [length, H, W, 6]
    rays = torch.cat([rays[:1].expand(TEMPORAL_STRIDE - 1, -1, -1, -1), rays])  # the first frame fills its latent frame
    grouped = rays.reshape(-1, TEMPORAL_STRIDE, height, width, PLUCKER_CHANNELS)  # [latent frames, 4, H, W, 6]
    return grouped.permute(4, 1, 0, 2, 3).reshape(1, PLUCKER_CHANNELS * TEMPORAL_STRIDE, -1, height, width)
