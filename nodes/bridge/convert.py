"""The one place that knows ComfyUI's IMAGE, LATENT and CONDITIONING types (layouts as in docs/nodes.md, Conventions)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


VACE_KEYS = ("vace_frames", "vace_mask", "vace_strength")


@dataclass
class Conditioning:
    """What the sampler reads from one ComfyUI CONDITIONING: prompt embeddings and native VACE contexts."""

    embeddings: list[torch.Tensor]  # [L, D], one per batch row
    vace_frames: list[torch.Tensor] = field(default_factory=list)
    vace_masks: list[torch.Tensor] = field(default_factory=list)
    vace_strengths: list[float] = field(default_factory=list)
    # image-to-video, as WanImageToVideo / WanFirstLastFrameToVideo set them (None without an image)
    image_latents: torch.Tensor | None = None  # concat_latent_image: raw latents of the conditioning video
    image_mask: torch.Tensor | None = None  # concat_mask: 0 where a frame is given
    clip_fea: torch.Tensor | None = None  # clip_vision_output's penultimate hidden states
    # Wan 2.2 Fun (Wan22FunControlToVideo): where the mask goes among the image latents, the reference latent
    image_mask_index: int = 0  # concat_mask_index
    reference_latent: torch.Tensor | None = None  # the last of reference_latents (raw), as native WAN21 takes it
    time_latents: torch.Tensor | None = None  # time_dim_concat (WanPhantomSubjectToVideo): raw latents after the frames
    camera_conditions: torch.Tensor | None = None  # WanCameraImageToVideo's camera embedding (Fun Camera)
    # Wan 2.2 Animate (WanAnimateToVideo): raw pose video latents and the face video in [-1, 1]; each pass its own
    pose_latents: torch.Tensor | None = None  # pose_video_latent
    face_pixels: torch.Tensor | None = None  # face_video_pixels (the negative's: all -1)
    audio_embed: torch.Tensor | None = None  # HuMo (WanHuMoImageToVideo): audio windows, the negative's zeros


def _tensor_or_none(value) -> torch.Tensor | None:
    return None if value is None else value.float().cpu()


def clip_vision_tokens(clip_vision_output) -> torch.Tensor | None:
    """The tokens Wan takes from a CLIP_VISION_OUTPUT (ComfyUI's or WanMesh's): its penultimate hidden states."""
    if clip_vision_output is None:
        return None
    return clip_vision_output["penultimate_hidden_states"].float().cpu()


def read_conditioning(conditioning, name: str = "CONDITIONING") -> Conditioning:
    """ComfyUI CONDITIONING ([[tensor[1, L, D], dict], ...]) -> embeddings and the VACE lists of its dict.

    Several entries (ConditioningCombine) would be evaluated one by one and averaged by ComfyUI's samplers;
    WanMesh samples one entry, so it refuses them rather than silently dropping all but the first."""
    if not isinstance(conditioning, (list, tuple)) or not conditioning:
        raise ValueError(f"{name} is empty; connect a text encode node")
    if len(conditioning) > 1:
        raise ValueError(f"{name} holds {len(conditioning)} entries (from ConditioningCombine); WanMesh samples one "
                         "entry per conditioning: use ConditioningConcat or a single prompt")
    tensor, options = conditioning[0][0], conditioning[0][1]
    if not isinstance(tensor, torch.Tensor) or tensor.ndim != 3:
        raise ValueError(f"{name} tensor must be [batch, tokens, width], got {getattr(tensor, 'shape', tensor)}")
    return Conditioning(
        embeddings=[row.float().cpu() for row in tensor],
        vace_frames=[t.float().cpu() for t in options.get("vace_frames", [])],
        vace_masks=[t.float().cpu() for t in options.get("vace_mask", [])],
        vace_strengths=[float(v) for v in options.get("vace_strength", [])],
        image_latents=_tensor_or_none(options.get("concat_latent_image")),
        image_mask=_tensor_or_none(options.get("concat_mask")),
        clip_fea=clip_vision_tokens(options.get("clip_vision_output")),
        image_mask_index=int(options.get("concat_mask_index", 0)),
        reference_latent=_tensor_or_none((options.get("reference_latents") or [None])[-1]),
        time_latents=_tensor_or_none(options.get("time_dim_concat")),
        camera_conditions=_tensor_or_none(options.get("camera_conditions")),
        pose_latents=_tensor_or_none(options.get("pose_video_latent")),
        face_pixels=_tensor_or_none(options.get("face_video_pixels")),
        audio_embed=_tensor_or_none(options.get("audio_embed")),
    )


def with_reference_audio(audio: torch.Tensor | None, reference: torch.Tensor | None) -> torch.Tensor | None:
    """HuMo's audio windows [B, F, ...] with a zero window for each frame of the reference latent after the video's,
    as ComfyUI's HumoWanModel pads them (unchanged without audio or reference)."""
    if audio is None or reference is None:
        return audio
    return torch.cat([audio, audio.new_zeros(audio.shape[0], reference.shape[2], *audio.shape[2:])], dim=1)


def humo_passes(positive: Conditioning, negative: Conditioning) -> dict:
    """The SampleRequest fields of HuMo's conditioning (WanHuMoImageToVideo's), as ComfyUI's HumoWanModel takes
    them: each pass's reference latent after the video's frames (time_latents), its audio windows with a zero
    window for each reference frame."""
    return {"time_latents": positive.reference_latent, "time_latents_negative": negative.reference_latent,
            "reference_latent": None,
            "audio_embed": with_reference_audio(positive.audio_embed, positive.reference_latent),
            "audio_embed_negative": with_reference_audio(negative.audio_embed, negative.reference_latent)}


ANIMATE_KEYS = ("pose_video_latent", "face_video_pixels")  # what WanAnimateToVideo adds to the conditioning


def animate_passes(positive: Conditioning, negative: Conditioning) -> dict:
    """The SampleRequest fields of each pass's Wan 2.2 Animate inputs, as native hands each pass its own (the
    negative's face video is all -1, WanAnimateToVideo's)."""
    return {"pose_latents": positive.pose_latents, "face_pixels": positive.face_pixels,
            "pose_latents_negative": negative.pose_latents, "face_pixels_negative": negative.face_pixels}


def negative_image(positive: Conditioning, negative: Conditioning) -> dict:
    """The SampleRequest fields of the negative pass's own image latents and mask, where they differ from the
    positive's (WanMoveTrackToVideo copies its track features into the positive's only); none where both carry the
    same. Both passes must carry image conditioning or neither, with the same CLIP vision tokens, reference latent
    and mask place."""
    def same(a, b) -> bool:
        return (a is None) == (b is None) and (a is None or (a.shape == b.shape and torch.equal(a, b)))

    if positive.image_mask_index != negative.image_mask_index:
        raise ValueError("positive and negative carry different concat_mask_index values; pass both through the "
                         "same image-to-video node (WanMesh applies one mask place to both passes)")
    if ((positive.image_latents is None) != (negative.image_latents is None)
            or not same(positive.clip_fea, negative.clip_fea)
            or not same(positive.reference_latent, negative.reference_latent)
            or not same(positive.camera_conditions, negative.camera_conditions)):
        raise ValueError("positive and negative carry different image-to-video conditioning (a start image, CLIP "
                         "vision tokens, a reference latent or a camera embedding the other lacks); pass both through the same "
                         "image-to-video node")
    if same(positive.image_latents, negative.image_latents) and same(positive.image_mask, negative.image_mask):
        return {}
    return {"image_latents_negative": negative.image_latents, "image_mask_negative": negative.image_mask}


def check_same_vace(positive: Conditioning, negative: Conditioning) -> None:
    """WanMesh applies one set of VACE contexts to both guidance passes, as WanVaceToVideo's outputs carry."""
    pairs = zip(positive.vace_frames + positive.vace_masks, negative.vace_frames + negative.vace_masks)
    same = (len(positive.vace_frames) == len(negative.vace_frames) and positive.vace_strengths == negative.vace_strengths
            and all(a.shape == b.shape and torch.equal(a, b) for a, b in pairs))
    if not same:
        raise ValueError(f"positive carries {len(positive.vace_frames)} VACE contexts and negative "
                         f"{len(negative.vace_frames)} different ones; pass both through the same VACE encode "
                         "(WanMesh applies one set of VACE contexts to both guidance passes)")


def with_vace(conditioning, frames: torch.Tensor, mask: torch.Tensor, strength: float) -> list:
    """A copy of CONDITIONING with one VACE context appended to every entry, as WanVaceToVideo does."""
    added = {"vace_frames": [frames], "vace_mask": [mask], "vace_strength": [strength]}
    result = []
    for tensor, options in conditioning:
        options = dict(options)
        for key, value in added.items():
            options[key] = list(options.get(key, [])) + value
        result.append([tensor, options])
    return result


def embeddings_to_conditioning(embeddings: list[torch.Tensor]) -> list:
    """Prompt embeddings (one prompt) -> ComfyUI CONDITIONING, as ComfyUI's own text encoders produce it."""
    (embedding,) = embeddings
    return [[embedding.unsqueeze(0), {}]]


def latent_to_tensor(latent: dict) -> torch.Tensor:
    """LATENT -> raw Wan latents [B, 16, T, h, w] (Wan 2.1 VAE) or [B, 48, T, h, w] (Wan 2.2 VAE)."""
    samples = latent["samples"]
    if samples.ndim != 5:
        raise ValueError(f"this LATENT is {list(samples.shape)}, not a Wan video latent [B, 16, T, H/8, W/8] or "
                         "[B, 48, T, H/16, W/16]")
    return samples.float().cpu()


def latent_noise_mask(latent: dict) -> torch.Tensor | None:
    """The LATENT's ``noise_mask`` (Wan22ImageToVideoLatent's, SetLatentNoiseMask's), as given; None without one."""
    return _tensor_or_none(latent.get("noise_mask"))


def tensor_to_latent(samples: torch.Tensor, noise_mask: torch.Tensor | None = None) -> dict:
    """A LATENT of raw latents; a noise mask stays with the latent, as ComfyUI's samplers pass it on."""
    return {"samples": samples} if noise_mask is None else {"samples": samples, "noise_mask": noise_mask}


def image_to_frames(image: torch.Tensor) -> torch.Tensor:
    """IMAGE [F, H, W, C] 0..1 -> frames [F, H, W, 3]."""
    if image.ndim != 4:
        raise ValueError(f"IMAGE must be [frames, height, width, channels], got {list(image.shape)}")
    return image[..., :3].float().cpu()


def frames_to_image(frames: torch.Tensor) -> torch.Tensor:
    return frames.float().cpu()
