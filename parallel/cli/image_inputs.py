"""`wanmesh generate --image START [--last-image END] [--clip-vision FILE] [--control-video FILE]`: image-to-video
and Fun Control on the command line; runs in the CLI (driver) process.

The model's kind (its header) decides what is needed: Wan 2.1 I2V a start image and a CLIP vision file, FLF2V a
start and an end image and a CLIP vision file, Wan 2.2 I2V A14B a start image only, Wan 2.2 TI2V 5B an optional
start image (its latents kept in the first frames, as native Wan22ImageToVideoLatent), Wan 2.1 and 2.2 Fun Camera no image
and an optional preset camera motion (``--camera-motion``: ``camera_motion.py``, native WanCameraEmbedding's); a
text-to-video model takes no image. Every such mistake is a one-line error before the pool starts. The conditioning is what ComfyUI's native
WanImageToVideo / WanFirstLastFrameToVideo make (``image_to_video.py``): the video is VAE-encoded on the pool; the
CLIP vision encoder (one or two images) runs here, as ComfyUI runs it in its own process. Fun Control models take
``--control-video`` and ``--image`` as the native nodes take them: Wan 2.1 Fun Control (48 input channels) as
WanFunControlToVideo's control video and start image (with the start image's CLIP vision tokens), Wan 2.2 Fun
Control A14B (52) and Fun 5B Control (148, on the Wan 2.2 VAE's 48-channel latents) as Wan22FunControlToVideo's
control video and reference image (``ref_image``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..config import (LATENT_CHANNELS, VAE_SPATIAL_FACTOR, WAN22_LATENT_CHANNELS, WAN22_LATENTS_MEAN,
                      WAN22_VAE_SPATIAL_FACTOR, check_video_size)
from ..image_to_video import (first_last_video, fun22_control_mask, fun_control_frames, fun_control_latents,
                              latent_frame_count, start_image_video, wan22_image_latent, wan22_start_frames)
from ..validation import model_image_inputs
from ..weights.detect import FUN22_5B_IN_CHANNELS
from .parser import IMAGE_FLAGS, MAX_CAMERA_SPEED, add_image_arguments, wants_image  # noqa: F401 - the parser's

KIND_NAMES = {"clip_vision": "Wan 2.1 I2V", "first_last": "Wan 2.1 FLF2V", "latents": "Wan 2.2 I2V A14B",
              "first_frame": "Wan 2.2 TI2V 5B", "fun_control": "Wan Fun Control",
              "animate": "Wan 2.2 Animate", "humo": "HuMo",
              "camera": "Wan Fun Camera"}
FUN_CONTROL_MODELS = "Wan 2.1 Fun Control, Wan 2.2 Fun Control A14B or Fun 5B Control"
FUN22_5B_CONTROL_IN_CHANNELS = FUN22_5B_IN_CHANNELS[-1]  # 148: control and start latents, the mask, the noise


def check_image_arguments(kind: str | None, args, clip_vision: str | None) -> None:
    """What the model of ``kind`` (``detect.image_inputs``) needs against what was given; one line each."""
    if getattr(args, "camera_motion", None) is not None and kind != "camera":
        raise ValueError("--camera-motion needs a Wan Fun Camera model (2.1 or 2.2: its camera adapter); this model has none: "
                         "leave --camera-motion out or load a Fun Camera model")
    if kind is None:
        if getattr(args, "control_video", None) is not None:
            raise ValueError("--control-video was given but the model is text-to-video; a control video needs a Fun "
                             f"Control model ({FUN_CONTROL_MODELS})")
        if wants_image(args):
            raise ValueError("--image/--last-image were given but the model is text-to-video; use an image-to-video "
                             "model (Wan 2.1 I2V / FLF2V, Wan 2.2 I2V A14B) or leave the images out")
        return
    name = KIND_NAMES[kind]
    if getattr(args, "control_video", None) is not None and kind != "fun_control":
        raise ValueError(f"--control-video was given but the model is {name}; a control video needs a Fun Control "
                         f"model ({FUN_CONTROL_MODELS})")
    if kind == "camera":
        _check_camera_arguments(name, args)
        return
    if kind == "fun_control":
        if args.last_image is not None:
            raise ValueError(f"the model is {name}, which takes a control video and one image; --last-image needs a "
                             "first-last-frame (FLF2V) model")
        return
    if kind == "animate":
        raise ValueError(f"the model is {name}, which takes a character image, a pose video and a face video; the "
                         "command line has no inputs for them: run it in ComfyUI with WanAnimateToVideo and KSampler on "
                         "the WanMesh MODEL (workflow native/animate_native)")
    if kind == "humo":
        raise ValueError(f"the model is {name}, which takes audio features (whisper's) and a reference image; the "
                         "command line has no inputs for them: run it in ComfyUI with AudioEncoderEncode, "
                         "WanHuMoImageToVideo and KSampler on the WanMesh MODEL or the WanMesh Sampler")
    if kind == "first_frame":  # text-to-video, or image-to-video from the start image's latents
        check_video_size(args.width, args.height, args.frames, WAN22_VAE_SPATIAL_FACTOR)
    elif args.image is None and not (kind == "first_last" and args.last_image is not None):
        raise ValueError(f"the model is {name}: give the start image with --image")
    if args.last_image is not None and kind != "first_last":
        raise ValueError(f"the model is {name}, which takes one image; --last-image needs a first-last-frame (FLF2V) "
                         "model")
    if kind in ("clip_vision", "first_last") and clip_vision is None:
        print(f"wanmesh: the model is {name} and no --clip-vision was given: sampling without CLIP vision tokens, as "
              "ComfyUI's WanImageToVideo / WanFirstLastFrameToVideo do without a CLIP vision output", file=sys.stderr,
              flush=True)


def _check_camera_arguments(name: str, args) -> None:
    """Fun Camera on the command line: a preset camera motion (``--camera-motion``, WanCameraEmbedding's) or none
    (the adapter unused, as native WanCameraImageToVideo without camera conditions); no start image (empty image
    channels, as WanCameraImageToVideo without one)."""
    if wants_image(args):
        raise ValueError(f"the model is {name}; the command line runs it without a start image (--camera-motion "
                         "only): for a start image use ComfyUI's WanCameraImageToVideo (workflow "
                         "native/fun_camera_native)")
    if not 0.0 <= args.camera_speed <= MAX_CAMERA_SPEED:
        raise ValueError(f"--camera-speed {args.camera_speed} is outside 0..{MAX_CAMERA_SPEED:g} (WanCameraEmbedding's "
                         "speed; 1 is the default)")
    if args.camera_motion is not None:
        check_video_size(args.width, args.height, args.frames, WAN22_VAE_SPATIAL_FACTOR)  # the adapter's 16 px cells
        return
    print(f"wanmesh: the model is {name} and no --camera-motion was given: sampling without a camera embedding, as "
          "ComfyUI's WanCameraImageToVideo does without one", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ImageInputs:
    """The images of an image-to-video run, read and checked before the pool starts."""

    kind: str
    start: torch.Tensor | None
    end: torch.Tensor | None
    clip_vision: str | None
    control: torch.Tensor | None = None  # a Fun Control model's control video [F, H, W, 3]
    in_channels: int = 0  # the model's input channels (Fun Control: 48 Wan 2.1, 52 Wan 2.2)
    camera_motion: str | None = None  # Fun Camera: a preset of parallel/camera_motion.py
    camera_speed: float = 1.0

    @classmethod
    def read(cls, args, files: dict) -> ImageInputs | None:
        from .media import read_image

        from .media import read_frames

        in_channels, kind = model_image_inputs(files["model"], "--model")
        if kind == "first_frame" and in_channels == FUN22_5B_CONTROL_IN_CHANNELS:
            kind = "fun_control"  # Wan 2.2 Fun 5B Control: Wan22FunControlToVideo's inputs, on 48-channel latents
            check_video_size(args.width, args.height, args.frames, WAN22_VAE_SPATIAL_FACTOR)
        clip_vision = files.get("clip_vision")
        check_image_arguments(kind, args, clip_vision)
        if kind == "camera":
            if args.camera_motion is None:
                return None
            return cls(kind, None, None, None, camera_motion=args.camera_motion, camera_speed=args.camera_speed)
        if kind is None:
            return None
        start = None if args.image is None else read_image(args.image, "--image")
        end = None if args.last_image is None else read_image(args.last_image, "--last-image")
        control = None if getattr(args, "control_video", None) is None else read_frames(args.control_video,
                                                                                         "--control-video")
        takes_tokens = kind in ("clip_vision", "first_last") or (kind == "fun_control" and _fun21(in_channels)
                                                                 and start is not None)
        return cls(kind, start, end, clip_vision if takes_tokens else None, control, in_channels)

    def sample_fields(self, runner, vae: str, args) -> dict:
        """The SampleRequest's image fields: the video encoded on the pool, its mask, the CLIP vision tokens; for
        TI2V the 48-channel latent (the start image's latents in its first frames) and its noise mask; for Fun
        Camera the camera embedding of the motion."""
        if self.kind == "camera":
            from ..camera_motion import camera_embedding

            return {"camera_conditions": camera_embedding(self.camera_motion, args.width, args.height, args.frames,
                                                          self.camera_speed)}
        if self.kind == "first_frame":
            frames = wan22_start_frames(self.start, args.width, args.height, args.frames)
            encoded = None if frames is None else runner.encode(vae, frames, tile_px=args.vae_tile,
                                                                 overlap_px=args.vae_overlap)
            latent = wan22_image_latent(encoded, args.width, args.height, args.frames, 1)
            return {"latent": latent["samples"], "noise_mask": latent.get("noise_mask")}
        if self.kind == "fun_control":
            return self._fun_control_fields(runner, vae, args)
        if self.kind == "first_last":
            video, mask = first_last_video(self.start, self.end, args.width, args.height, args.frames)
        else:
            video, mask = start_image_video(self.start, args.width, args.height, args.frames)
        latents = runner.encode(vae, video, tile_px=args.vae_tile, overlap_px=args.vae_overlap)
        return {"image_latents": latents, "image_mask": mask, "clip_fea": self._clip_tokens()}

    def _fun_control_fields(self, runner, vae: str, args) -> dict:
        """WanFunControlToVideo's (Wan 2.1) or Wan22FunControlToVideo's (Wan 2.2) conditioning of the control video
        and the image: the raw concatenated latents, the Wan 2.2 mask and mask channel, its reference latent; for
        Fun 5B Control all on the Wan 2.2 VAE's 48-channel latents (16x), with the empty 48-channel latent."""
        from ..sampling.latents import LATENTS_MEAN

        def encode(images):
            frames = fun_control_frames(images, args.width, args.height, args.frames)
            return None if frames is None else runner.encode(vae, frames, tile_px=args.vae_tile,
                                                             overlap_px=args.vae_overlap)

        five_b = self.in_channels == FUN22_5B_CONTROL_IN_CHANNELS
        channels, factor = (WAN22_LATENT_CHANNELS, WAN22_VAE_SPATIAL_FACTOR) if five_b else (LATENT_CHANNELS,
                                                                                              VAE_SPATIAL_FACTOR)
        mean = torch.tensor(WAN22_LATENTS_MEAN) if five_b else LATENTS_MEAN.flatten()
        shape = (1, channels, latent_frame_count(args.frames), args.height // factor, args.width // factor)
        if _fun21(self.in_channels):
            latents = fun_control_latents(encode(self.control), encode(self.start), shape, mean)
            return {"image_latents": latents, "clip_fea": self._clip_tokens()}
        reference = None if self.start is None else encode(self.start[:1])
        fields = {"image_latents": fun_control_latents(encode(self.control), None, shape, mean),
                  "image_mask": fun22_control_mask(shape), "image_mask_index": channels, "reference_latent": reference}
        return {**fields, "latent": torch.zeros(shape)} if five_b else fields

    def _clip_tokens(self) -> torch.Tensor | None:
        if self.clip_vision is None:
            return None
        from ..networks.clip_vision import encode_images
        from ..weights.clip_vision_files import load_clip_vision

        encoder = load_clip_vision(self.clip_vision)
        images = [image for image in (self.start, self.end) if image is not None]
        return torch.cat([encode_images(encoder, image[..., :3]).penultimate_hidden_states for image in images],
                         dim=-2)


def _fun21(in_channels: int) -> bool:
    """Wan 2.1 Fun Control (48 input channels: no mask, CLIP vision tokens), not Wan 2.2's (52)."""
    return in_channels == 3 * LATENT_CHANNELS
