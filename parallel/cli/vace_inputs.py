"""The VACE flags of `wanmesh generate`: reading, building and checking the VACE inputs; runs in the CLI (driver) process.

Usage (without --model the tiny built-in VACE model is used; --model a VACE file, or a T2V file plus
--vace-module, for real models)::

    wanmesh generate --prompt "a fox" --out fox.mp4 --vace-video walk.mp4 --vace-control canny
    wanmesh generate --prompt "a fox" --out wide.mp4 --vace-video walk.mp4 --outpaint 64,0,64,0
    wanmesh generate --prompt "a fox" --out more.mp4 --vace-video walk.mp4 --extend-keep 5,0 --frames 33
    wanmesh generate --prompt "a fox" --out edit.mp4 --vace-video walk.mp4 --vace-mask box.png
    wanmesh generate --prompt "a fox" --out ref.mp4 --vace-ref fox.png --vace-ref hat.png \\
        --vace-strength 0.8 --save-vace context.safetensors --save-latents latents.safetensors

--vace-video / --vace-mask take an MP4 (or other video), an image or a folder of frames (``media.py``); the mask
is the frames' luminance, white = generate. --vace-control turns the video into a control video
(``vace/builders.control_from_video``); then at most one of --vace-mask (inpaint), --outpaint L,T,R,B (the canvas
grows) or --extend-keep FIRST,LAST (keep the video's first/last frames, generate the rest) sets the mask.
--vace-ref images are composited on white and fitted into the canvas, one latent frame each (trimmed after
sampling). --width/--height default to the video's size (the padded size with --outpaint), --frames to its
frame count (rounded down to 4k+1). Everything is read and checked here before any worker process starts.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import check_vace_contexts, latent_shape
from ..weights.checkpoint import resolve_model_location
from ..weights.detect import KIND_DESCRIPTIONS, safetensors_kind
from ..protocol import EncodeVace, VaceEncoded
from ..tensor_files import save_tensors_atomic
from ..vace import builders
from ..vace.encode import check_encode_inputs, frame_count_changes
from .media import read_frames, read_image, read_mask

from .parser import NEEDS_VIDEO, SETS_MASK, VACE_FLAGS, add_vace_arguments, wants_vace  # noqa: F401 - the parser's


def _given(args, names) -> list[str]:
    return [VACE_FLAGS[name] for name in names if getattr(args, name) is not None]


def _whole_numbers(text: str, flag: str, names: tuple[str, ...]) -> tuple[int, ...]:
    """`text` as len(names) comma-separated whole numbers >= 0."""
    parts = [part.strip() for part in text.split(",")]
    example = ",".join("0" for _ in names)
    if len(parts) != len(names) or not all(part.isdigit() for part in parts):
        raise ValueError(f"{flag} takes {len(names)} comma-separated whole numbers >= 0 "
                         f"{','.join(names)} (e.g. {example}), got {text!r}")
    return tuple(int(part) for part in parts)


def _check_flag_combination(args) -> None:
    without_video = _given(args, NEEDS_VIDEO) if args.vace_video is None else []
    if without_video:
        raise ValueError(f"{without_video[0]} works on --vace-video; give --vace-video PATH")
    masks = _given(args, SETS_MASK)
    if len(masks) > 1:
        raise ValueError(f"{' and '.join(masks)} each set the VACE mask; give at most one of "
                         f"{', '.join(VACE_FLAGS[name] for name in SETS_MASK)}")


def _without_vace(path: str) -> str | None:
    """What a transformer file (its header) or folder (its config.json) is when it surely has no VACE blocks."""
    location = resolve_model_location(path, "transformer")
    if location.is_file():
        kind = safetensors_kind(str(location))
        return KIND_DESCRIPTIONS[kind] if kind in ("wan_t2v", "wan_i2v") else None
    class_name = json.loads((location / "config.json").read_text()).get("_class_name")
    return f"a {class_name} folder" if class_name == "WanTransformer3DModel" else None


def check_model_takes_vace(args, files: dict) -> None:
    """A VACE flag with a model that has no VACE blocks fails here, from the file header alone."""
    if files.get("vace_module") is not None:
        return  # the module adds the VACE blocks; the loader checks that it fits
    found = _without_vace(files["model"])
    if found is not None:
        flag = _given(args, VACE_FLAGS)[0]
        raise ValueError(f"{flag} needs a VACE model, but --model {files['model']} is {found}; "
                         f"give a VACE model as --model or add --vace-module FILE")


@dataclass
class VaceSources:
    """What the VACE flags read from disk, before the video size is known: ComfyUI IMAGE / MASK tensors."""

    video: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    references: list[torch.Tensor] = field(default_factory=list)
    control: str | None = None
    strength: float = 1.0
    outpaint: tuple[int, ...] | None = None
    extend_keep: tuple[int, ...] | None = None
    save_path: Path | None = None

    def canvas(self) -> tuple[int, int] | None:
        """(width, height) of the video (the padded canvas with --outpaint), else of the mask."""
        source = self.video if self.video is not None else self.mask
        if source is None:
            return None
        height, width = source.shape[1:3]
        if self.outpaint is not None:
            left, top, right, bottom = self.outpaint
            width, height = width + left + right, height + top + bottom
        return width, height

    def control_and_masks(self, length: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The builders applied in order: control mode, then inpaint / outpaint / extend."""
        video = self.video
        if video is not None and self.control is not None:
            video = builders.control_from_video(video, self.control)
        if self.mask is not None and video is not None:
            return builders.inpaint_from_mask(video, self.mask)
        if self.outpaint is not None:
            return builders.outpaint(video, *self.outpaint)
        if self.extend_keep is not None:
            return builders.extend(video, length, *self.extend_keep)
        if self.mask is not None and self.mask.shape[0] == 1:
            return video, self.mask.expand(length, -1, -1)  # one mask image applies to every frame
        return video, self.mask

    def build(self, width: int, height: int, length: int) -> "VaceInputs":
        """The encode inputs at the final size, checked (before any worker starts)."""
        video, masks = self.control_and_masks(length)
        references = None
        if self.references:
            references = torch.cat([builders.reference_images(image, width, height) for image in self.references])
        check_encode_inputs(width, height, length, video, masks, references)
        for change in frame_count_changes(length, video, masks):
            print(f"wanmesh: VACE: {change}, as ComfyUI's WanVaceToVideo does", file=sys.stderr, flush=True)
        inputs = VaceInputs(video, masks, references, self.strength, self.save_path)
        inputs.check_fits(width, height, length)
        return inputs


def read_vace_inputs(args, files: dict) -> VaceSources | None:
    """Read the VACE flags' files and set --width/--height/--frames defaults from the video; None without VACE.

    The cheap checks (flag combinations, numbers, the model header) come before any file is read."""
    if not wants_vace(args):
        return None
    _check_flag_combination(args)
    sources = VaceSources(
        control=args.vace_control, strength=1.0 if args.vace_strength is None else args.vace_strength,
        outpaint=None if args.outpaint is None else _whole_numbers(args.outpaint, "--outpaint", ("L", "T", "R", "B")),
        extend_keep=None if args.extend_keep is None else _whole_numbers(
            args.extend_keep, "--extend-keep", ("FIRST", "LAST")),
        save_path=args.save_vace,
    )
    check_model_takes_vace(args, files)
    sources.video = None if args.vace_video is None else read_frames(args.vace_video, "--vace-video")
    sources.mask = None if args.vace_mask is None else read_mask(args.vace_mask, "--vace-mask")
    sources.references = [read_image(path, "--vace-ref") for path in args.vace_ref or []]
    _default_size_from(sources, args)
    return sources


def _default_size_from(sources: VaceSources, args) -> None:
    """--width/--height from the video (padded with --outpaint) or else the mask; --frames from the video."""
    canvas = sources.canvas()
    if canvas is None:
        return
    width, height = canvas
    args.width = width if args.width is None else args.width
    args.height = height if args.height is None else args.height
    if args.frames is None and sources.video is not None and sources.extend_keep is None:
        args.frames = (sources.video.shape[0] - 1) // 4 * 4 + 1  # the longest 4k+1 clip the video covers


@dataclass
class VaceInputs:
    """One VACE context's inputs, built and checked: what `EncodeVace` takes, plus the strength."""

    control_video: torch.Tensor | None
    control_masks: torch.Tensor | None
    reference_images: torch.Tensor | None
    strength: float
    save_path: Path | None

    @property
    def reference_count(self) -> int:
        return 0 if self.reference_images is None else self.reference_images.shape[0]

    def check_fits(self, width: int, height: int, length: int) -> None:
        """The context this makes fits the latent it is sampled with, and the strength is finite (config checks)."""
        batch, channels, frames, h, w = latent_shape(width, height, length)
        positions = (self.reference_count + frames, h, w)
        shapes = [(1, 32, *positions), (1, 64, *positions)]
        vace_frames, vace_mask = (torch.empty(shape, device="meta") for shape in shapes)
        check_vace_contexts([vace_frames], [vace_mask], [self.strength], (batch, channels, *positions))

    def encode(self, runner, vae: str, args) -> VaceEncoded:
        """The native context, VAE-encoded on the pool (tiled like the decode); written when --save-vace asks."""
        encoded = runner.encode_vace(EncodeVace(
            handle=vae, width=args.width, height=args.height, length=args.frames, control_video=self.control_video,
            control_masks=self.control_masks, reference_images=self.reference_images, tile_px=args.vae_tile,
            overlap_px=args.vae_overlap))
        self.save(encoded)
        return encoded

    def sample_fields(self, encoded: VaceEncoded) -> dict:
        """The SampleRequest fields of this context."""
        return {"vace_frames": [encoded.frames], "vace_masks": [encoded.mask], "vace_strengths": [self.strength]}

    def save(self, encoded: VaceEncoded) -> None:
        if self.save_path is not None:
            tensors = {"vace_frames": encoded.frames.float().contiguous(), "vace_mask": encoded.mask.float().contiguous()}
            save_tensors_atomic(tensors, self.save_path)
