"""ComfyUI nodes that build VACE inputs (masks, reference images, control videos); run in the ComfyUI driver process.

Thin wrappers: each node calls one builder of `parallel/vace/builders.py`. The outputs plug into ComfyUI's
`WanVaceToVideo` (control_video, control_masks, reference_image) or the WanMesh VACE encode.
"""

from __future__ import annotations

from ..parallel.fields import node_input
from ..parallel.vace.builders import (
    MASK_MODES,
    box_mask,
    control_from_video,
    extend,
    first_last_frame,
    inpaint_from_mask,
    outpaint,
    reference_images,
)

CATEGORY = "WanMesh/vace"
MAX_SIZE = 8192
MAX_FRAMES = 1025


def _size(default: int, tooltip: str, minimum: int = 16) -> tuple:
    return ("INT", {"default": default, "min": minimum, "max": MAX_SIZE, "step": 16, "tooltip": tooltip})


def _pixels(tooltip: str, default: int = 0, minimum: int = 0) -> tuple:
    return ("INT", {"default": default, "min": minimum, "max": MAX_SIZE, "step": 1, "tooltip": tooltip})


def _frames(tooltip: str, default: int = 0) -> tuple:
    return ("INT", {"default": default, "min": 0, "max": MAX_FRAMES, "step": 1, "tooltip": tooltip})


def _require(mode: str, **inputs) -> None:
    """One-line error naming the first input `mode` needs that is not connected."""
    for name, value in inputs.items():
        if value is None:
            raise ValueError(f"WanMeshVaceMask: mode '{mode}' needs the '{name}' input; connect it")


class WanMeshVaceMask:
    DESCRIPTION = ("Builds a VACE control video (grey = generate) and mask (1 = generate, 0 = keep) for inpainting, "
                   "a moving box, outpainting, video extension or first/last-frame video; feed both to "
                   "WanVaceToVideo.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "mode": (list(MASK_MODES), {"default": "inpaint", "tooltip":
                         "inpaint: video + mask; box: a (moving) box on a width x height canvas; outpaint: pad the "
                         "video; extend: keep the video's first/last frames and generate the rest; first_last: "
                         "generate between a first frame (video) and an optional last_image"}),
                "width": _size(832, "canvas width in pixels for box mode (multiple of 16, 16..8192)"),
                "height": _size(480, "canvas height in pixels for box mode (multiple of 16, 16..8192)"),
                "length": ("INT", {"default": 81, "min": 1, "max": MAX_FRAMES, "step": 4, "tooltip":
                           "frames to build for box, extend and first_last (4k+1: 1, 5, ..., 81, ...)"}),
            },
            "optional": {
                "video": ("IMAGE", {"tooltip": "the source video: needed by inpaint, outpaint and extend; the first "
                                    "frame of first_last (its first frame is used); optional background for box"}),
                "mask": ("MASK", {"tooltip": "inpaint only: 1 = generate, 0 = keep, values 0..1; as many frames as "
                                  "the video, or 1 frame for all"}),
                "box_x": _pixels("box: left edge in pixels of the box on the first frame (may start off-canvas)",
                                 minimum=-MAX_SIZE),
                "box_y": _pixels("box: top edge in pixels of the box on the first frame (may start off-canvas)",
                                 minimum=-MAX_SIZE),
                "box_w": _pixels("box: width in pixels of the box on the first frame (1..8192)", 256, 1),
                "box_h": _pixels("box: height in pixels of the box on the first frame (1..8192)", 256, 1),
                "end_box_x": _pixels("box: left edge in pixels on the last frame", minimum=-MAX_SIZE),
                "end_box_y": _pixels("box: top edge in pixels on the last frame", minimum=-MAX_SIZE),
                "end_box_w": _pixels("box: width in pixels on the last frame; 0 = the box stays still"),
                "end_box_h": _pixels("box: height in pixels on the last frame (used when end_box_w > 0; 1..8192)",
                                     256, 1),
                "pad_left": _pixels("outpaint: pixels added on the left (>= 0; the padded width must be a "
                                    "multiple of 16)"),
                "pad_top": _pixels("outpaint: pixels added on top (>= 0; the padded height must be a multiple "
                                   "of 16)"),
                "pad_right": _pixels("outpaint: pixels added on the right (>= 0; the padded width must be a "
                                     "multiple of 16)"),
                "pad_bottom": _pixels("outpaint: pixels added at the bottom (>= 0; the padded height must be a "
                                      "multiple of 16)"),
                "keep_first": _frames("extend: how many of the video's first frames open the result unchanged "
                                      "(0..video frames; keep_first + keep_last <= length)", 1),
                "keep_last": _frames("extend: how many of the video's last frames close the result unchanged "
                                     "(0..video frames; keep_first + keep_last <= length)"),
                "last_image": ("IMAGE", {"tooltip": "first_last: the frame to end on (its last frame is used; same "
                                         "size as the video); leave empty to generate freely after the first frame"}),
            },
        }

    RETURN_TYPES = ("IMAGE", "MASK")
    RETURN_NAMES = ("control_video", "control_masks")
    FUNCTION = "build"
    CATEGORY = CATEGORY

    def build(self, mode, width, height, length, video=None, mask=None, box_x=0, box_y=0, box_w=256, box_h=256,
              end_box_x=0, end_box_y=0, end_box_w=0, end_box_h=256, pad_left=0, pad_top=0, pad_right=0,
              pad_bottom=0, keep_first=1, keep_last=0, last_image=None):
        if mode == "inpaint":
            _require(mode, video=video, mask=mask)
            return inpaint_from_mask(video, mask)
        if mode == "box":
            end_box = (end_box_x, end_box_y, end_box_w, end_box_h) if end_box_w > 0 else None
            return box_mask(width, height, length, (box_x, box_y, box_w, box_h), end_box, video)
        if mode == "outpaint":
            _require(mode, video=video)
            return outpaint(video, pad_left, pad_top, pad_right, pad_bottom)
        if mode == "extend":
            _require(mode, video=video)
            return extend(video, length, keep_first, keep_last)
        if mode == "first_last":
            _require(mode, video=video)
            return first_last_frame(video[:1], None if last_image is None else last_image[-1:], length)
        raise ValueError(f"WanMeshVaceMask: unknown mode {mode!r}; valid: {', '.join(MASK_MODES)}")


class WanMeshVaceReference:
    DESCRIPTION = ("Prepares VACE reference images: composites each on white (transparency from RGBA or the alpha "
                   "mask) and fits it, aspect ratio kept, into width x height; feed to WanVaceToVideo's "
                   "reference_image.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "images": ("IMAGE", {"tooltip": "one or more reference images, RGB or RGBA, values 0..1"}),
                "width": _size(832, "output width in pixels, the video's width (multiple of 16, 16..8192)"),
                "height": _size(480, "output height in pixels, the video's height (multiple of 16, 16..8192)"),
            },
            "optional": {
                "alpha": ("MASK", {"tooltip": "opacity, 1 = opaque, 0 = transparent (white), values 0..1; one per "
                                   "image or 1 for all; overrides an RGBA alpha. LoadImage's MASK is the inverse "
                                   "(1 = transparent): put it through InvertMask first"}),
            },
        }

    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("reference_image",)
    FUNCTION = "build"
    CATEGORY = CATEGORY

    def build(self, images, width, height, alpha=None):
        return (reference_images(images, width, height, alpha),)


class WanMeshVaceControl:
    DESCRIPTION = ("Turns a video into a VACE control video: Canny edges, scribble strokes, grey luminance, colour "
                   "optical flow, or the frames as they are (for depth/pose maps from other packs); optionally "
                   "centre-cropped and resized.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "video": ("IMAGE", {"tooltip": "the video to derive the control from (values 0..1)"}),
                "mode": node_input("vace_control"),
                "low_threshold": ("INT", {"default": 100, "min": 0, "max": 1000, "step": 1, "tooltip":
                                  "canny/scribble: lower Canny hysteresis threshold (0..1000, <= high_threshold)"}),
                "high_threshold": ("INT", {"default": 200, "min": 0, "max": 1000, "step": 1, "tooltip":
                                   "canny/scribble: upper Canny hysteresis threshold (0..1000, >= low_threshold)"}),
            },
            "optional": {
                "width": _size(0, "output width in pixels (multiple of 16, up to 8192); 0 = keep the video's size "
                                  "(set width and height together)", minimum=0),
                "height": _size(0, "output height in pixels (multiple of 16, up to 8192); 0 = keep the video's size "
                                   "(set width and height together)", minimum=0),
            },
        }

    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("control_video",)
    FUNCTION = "build"
    CATEGORY = CATEGORY

    def build(self, video, mode, low_threshold, high_threshold, width=0, height=0):
        return (control_from_video(video, mode, width or None, height or None, low_threshold, high_threshold),)
