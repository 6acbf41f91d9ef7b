"""Wan 2.2 Animate's motion encoder split over the frames of two ranks (``distributed/frame_split.py``): each rank
encodes its own slice of the face frames, and the face tokens equal one rank's unsplit ones (uneven slices and a
rank without frames included)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from wanmesh.parallel.distributed.frame_split import apply_frame_split
from wanmesh.parallel.distributed.spawn import spawn_ranks
from wanmesh.parallel.networks.wan_animate import FACE_SIZE, WanAnimateTransformer
from wanmesh.parallel.tiny.models import NATIVE_ANIMATE, randomise_

SEED = 35
LATENT_FRAMES = 3


def _model() -> WanAnimateTransformer:
    """The tiny Animate model with random weights, the same on every rank (the motion encoder's at unit scale, as
    the tiny files draw them, so its output varies with the face)."""
    model = WanAnimateTransformer.from_config(NATIVE_ANIMATE).eval()
    randomise_(model, SEED)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for parameter in model.motion_encoder.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model


def _encoded_frames(model: WanAnimateTransformer) -> list[int]:
    """The frame counts the motion encoder's convolutions see, call by call."""
    seen: list[int] = []
    model.motion_encoder.enc.net_app.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[0]))
    return seen


def _check_split(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = _model()
    videos = {count: torch.rand(1, 3, count, FACE_SIZE, FACE_SIZE) * 2 - 1 for count in (3, 1)}
    with torch.no_grad():
        reference = {count: model.face_tokens(pixels, LATENT_FRAMES) for count, pixels in videos.items()}
        apply_frame_split(model, [None, dist.group.WORLD])  # a group of one rank (None) is left out
        seen = _encoded_frames(model)
        for count, pixels in videos.items():
            split = model.face_tokens(pixels, LATENT_FRAMES)
            torch.testing.assert_close(split, reference[count], rtol=1e-5, atol=1e-5)
    # 3 frames: ranks 0 and 1 encode 2 and 1; 1 frame: rank 0 encodes it, rank 1 none
    assert seen == ([2, 1] if rank == 0 else [1, 0]), seen


def test_two_ranks_split_the_face_frames_and_equal_one_rank() -> None:
    spawn_ranks(_check_split, 2, deadline_s=240)


def test_one_rank_or_a_model_without_per_frame_encoders_is_left_untouched() -> None:
    model = torch.nn.Linear(2, 2)
    assert apply_frame_split(model, [None, None]) is model and not hasattr(model, "frame_split")
