"""VACE input builders: masks, control videos and reference images for VACE, as pure functions.

Runs in the driver process (ComfyUI or the command line), before any worker work. Every function takes and
returns ComfyUI's types: IMAGE = float32 [frames, H, W, 3] in 0..1, MASK = float32 [frames, H, W] in 0..1 with
1 = generate/edit and 0 = keep. The (control_video, control_masks) pairs feed ComfyUI's `WanVaceToVideo` (or the
WanMesh VACE encode) directly; grey (0.5) marks pixels that VACE generates. Bad input raises a one-line ValueError
before any work. OpenCV is imported inside the functions that use it, so importing this module stays light.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..config import CONTROL_MODES, SPATIAL_STRIDE, check_frame_count, check_frame_size

GREY = 0.5
MASK_MODES = ("inpaint", "box", "outpaint", "extend", "first_last")
CONTROL_MODE_ALIASES = {"passthrough": "none"}
LUMA_WEIGHTS = (0.299, 0.587, 0.114)  # ITU-R BT.601, the weights of OpenCV's RGB2GRAY
FARNEBACK_PARAMS = dict(pyr_scale=0.5, levels=3, winsize=15, iterations=3, poly_n=5, poly_sigma=1.2, flags=0)
MIN_FLOW_SCALE_PX = 1.0  # flow brightness is magnitude / max(largest magnitude, this): sub-pixel jitter stays dark


# ---------------------------------------------------------------------------------------------- validation


def _shape(value) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def _check_image(name: str, image, channels: Sequence[int] = (3,)) -> torch.Tensor:
    """An IMAGE [frames, H, W, C] with C in `channels`, as float32."""
    valid = "/".join(str(c) for c in channels)
    if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[-1] not in channels:
        raise ValueError(f"{name} must be an IMAGE [frames, height, width, {valid}], got {_shape(image)}")
    if 0 in image.shape:
        raise ValueError(f"{name} is empty: {list(image.shape)}")
    return image.float()


def _check_mask(name: str, mask) -> torch.Tensor:
    """A MASK [frames, H, W] (a single [H, W] mask counts as one frame), as float32."""
    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
        mask = mask.unsqueeze(0)
    if not isinstance(mask, torch.Tensor) or mask.ndim != 3 or 0 in mask.shape:
        raise ValueError(f"{name} must be a MASK [frames, height, width], got {_shape(mask)}")
    return mask.float()


def _check_unit_range(name: str, values: torch.Tensor) -> None:
    low, high = values.min().item(), values.max().item()
    if low < 0.0 or high > 1.0:
        raise ValueError(f"{name} values must lie in 0..1, found min {low:g} and max {high:g}")


def _check_length(where: str, length: int) -> None:
    check_frame_count(length, f"{where}: length")


def _check_canvas(where: str, width: int, height: int) -> None:
    check_frame_size(width, height, SPATIAL_STRIDE, where=f"{where}: ")


def _check_count(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------------------------- helpers


def _grey_where(video: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Blend each pixel towards grey by its mask value (1: grey, 0: unchanged; exact at both ends)."""
    weight = masks.unsqueeze(-1)
    return video * (1.0 - weight) + GREY * weight


def _grey_frames(frames: int, height: int, width: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """An all-grey control video and an all-ones (generate everything) mask."""
    video = torch.full((frames, height, width, 3), GREY, dtype=torch.float32, device=device)
    return video, torch.ones(frames, height, width, dtype=torch.float32, device=device)


def _round_half_up(values: torch.Tensor) -> torch.Tensor:
    return torch.floor(values + 0.5)


def _resize(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Bilinear resize of [N, H, W, C] frames (antialiased when shrinking); the same tensor when sizes match."""
    if tuple(frames.shape[1:3]) == (height, width):
        return frames
    channels_first = frames.permute(0, 3, 1, 2)
    resized = F.interpolate(channels_first, size=(height, width), mode="bilinear", align_corners=False,
                            antialias=True)
    return resized.permute(0, 2, 3, 1).clamp(0.0, 1.0).contiguous()


def _resize_cover(frames: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Centre-crop [F, H, W, C] frames to the aspect ratio of width x height, then resize bilinearly to it."""
    _, frame_h, frame_w, _ = frames.shape
    crop_w = min(frame_w, round(frame_h * width / height))
    crop_h = min(frame_h, round(frame_w * height / width))
    top, left = (frame_h - crop_h) // 2, (frame_w - crop_w) // 2
    return _resize(frames[:, top:top + crop_h, left:left + crop_w], height, width)


# ---------------------------------------------------------------------------------------------- mask builders


def inpaint_from_mask(video: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inpainting: masked pixels (1) turn grey in the control video; the mask passes through.

    A single-frame mask applies to every frame of the video.
    """
    video = _check_image("inpaint: video", video)
    mask = _check_mask("inpaint: mask", mask).to(video.device)
    frames, height, width, _ = video.shape
    if mask.shape[0] not in (frames, 1):
        raise ValueError(f"inpaint: mask has {mask.shape[0]} frames but the video has {frames}; "
                         f"give {frames} mask frames or 1 (used for every frame)")
    if tuple(mask.shape[1:]) != (height, width):
        raise ValueError(f"inpaint: mask is {mask.shape[2]}x{mask.shape[1]} (width x height) but the video is "
                         f"{width}x{height}; they must match")
    _check_unit_range("inpaint: mask", mask)
    masks = mask.expand(frames, height, width).contiguous()
    return _grey_where(video, masks), masks


def _check_box(name: str, box, width: int, height: int) -> torch.Tensor:
    """A box (x, y, w, h) in pixels with positive size that overlaps the canvas, as float64 [4]."""
    if not isinstance(box, (tuple, list)) or len(box) != 4:
        raise ValueError(f"box_mask: {name} must be (x, y, w, h), got {box!r}")
    x, y, box_w, box_h = (float(v) for v in box)
    if box_w <= 0 or box_h <= 0:
        raise ValueError(f"box_mask: {name} {tuple(box)} has size {box_w:g}x{box_h:g}; width and height must be > 0")
    left, top, pixels_w, pixels_h = _whole_pixel_boxes(torch.tensor([[x, y, box_w, box_h]], dtype=torch.float64))[0]
    if left >= width or top >= height or left + pixels_w <= 0 or top + pixels_h <= 0:
        raise ValueError(f"box_mask: {name} {tuple(box)} lies outside the {width}x{height} canvas; "
                         f"it must overlap x 0..{width - 1} and y 0..{height - 1}")
    return torch.tensor([x, y, box_w, box_h], dtype=torch.float64)


def _whole_pixel_boxes(boxes: torch.Tensor) -> torch.Tensor:
    """Boxes [N, 4] (x, y, w, h) rounded to whole pixels (halves up), at least 1 pixel wide and high."""
    rounded = _round_half_up(boxes)
    rounded[:, 2:] = rounded[:, 2:].clamp(min=1)
    return rounded


def _box_masks(start: torch.Tensor, end: torch.Tensor, width: int, height: int, length: int) -> torch.Tensor:
    """[length, height, width] masks of a box moving linearly from `start` to `end`, whole pixels, clipped."""
    progress = torch.linspace(0.0, 1.0, length, dtype=torch.float64)  # one frame: [0.0], the start box
    x, y, box_w, box_h = _whole_pixel_boxes(start + progress[:, None] * (end - start)).unbind(1)
    columns = torch.arange(width, dtype=torch.float64)
    rows = torch.arange(height, dtype=torch.float64)
    in_columns = (columns >= x[:, None]) & (columns < (x + box_w)[:, None])
    in_rows = (rows >= y[:, None]) & (rows < (y + box_h)[:, None])
    return (in_rows[:, :, None] & in_columns[:, None, :]).float()


def box_mask(width: int, height: int, length: int, start_box: Sequence[float], end_box: Sequence[float] | None = None,
             video: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A box to generate (1) on a kept background (0), moving linearly from start_box to end_box over the frames.

    Boxes are (x, y, w, h) in pixels; each frame's box is rounded to whole pixels (halves round up) and clipped to
    the canvas. end_box None keeps the box still. The control video is `video` ([length, height, width, 3]) with the
    box greyed, or all grey without a video.
    """
    _check_canvas("box_mask", width, height)
    _check_length("box_mask", length)
    start = _check_box("start_box", start_box, width, height)
    end = start if end_box is None else _check_box("end_box", end_box, width, height)
    if video is None:
        control, _ = _grey_frames(length, height, width)
    else:
        control = _check_image("box_mask: video", video)
        if tuple(control.shape[:3]) != (length, height, width):
            raise ValueError(f"box_mask: video is {list(control.shape[:3])} (frames, height, width) but the mask is "
                             f"{[length, height, width]}; they must match")
    masks = _box_masks(start, end, width, height, length).to(control.device)
    return _grey_where(control, masks), masks


def _padding_advice(size: int, far_pad: int, far_name: str) -> str:
    """The nearest paddings on the right/bottom side that make `size` a multiple of 16."""
    excess = size % SPATIAL_STRIDE
    options = [far_pad - excess, far_pad + SPATIAL_STRIDE - excess]
    return f"{far_name} " + " or ".join(str(p) for p in options if p >= 0)


def outpaint(video: torch.Tensor, left: int, top: int, right: int, bottom: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Outpainting: the canvas grows by the paddings (pixels); padding is grey / mask 1, the video keeps mask 0."""
    video = _check_image("outpaint: video", video)
    left, top, right, bottom = (_check_count(f"outpaint: pad_{name}", value) for name, value in
                                (("left", left), ("top", top), ("right", right), ("bottom", bottom)))
    frames, height, width, _ = video.shape
    new_w, new_h = width + left + right, height + top + bottom
    if new_w % SPATIAL_STRIDE or new_h % SPATIAL_STRIDE:
        advice = [_padding_advice(new_w, right, "pad_right")] if new_w % SPATIAL_STRIDE else []
        advice += [_padding_advice(new_h, bottom, "pad_bottom")] if new_h % SPATIAL_STRIDE else []
        raise ValueError(f"outpaint: padded size {new_w}x{new_h} (width x height) must be multiples of "
                         f"{SPATIAL_STRIDE}; nearest valid with the other paddings unchanged: {', '.join(advice)}")
    control, masks = _grey_frames(frames, new_h, new_w, device=video.device)
    control[:, top:top + height, left:left + width] = video
    masks[:, top:top + height, left:left + width] = 0.0
    return control, masks


def extend(video: torch.Tensor, length: int, keep_first: int, keep_last: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Extension: `length` frames; the video's first keep_first frames open it and its last keep_last frames close
    it (exact copies, mask 0); every other frame is grey with mask 1."""
    video = _check_image("extend: video", video)
    _check_length("extend", length)
    keep_first = _check_count("extend: keep_first", keep_first)
    keep_last = _check_count("extend: keep_last", keep_last)
    frames, height, width, _ = video.shape
    kept = keep_first + keep_last
    if kept > length:
        raise ValueError(f"extend: keep_first {keep_first} + keep_last {keep_last} = {kept} frames do not fit in "
                         f"length {length}")
    if kept > frames:
        raise ValueError(f"extend: keep_first {keep_first} + keep_last {keep_last} = {kept} frames, but the video "
                         f"has only {frames}")
    control, masks = _grey_frames(length, height, width, device=video.device)
    control[:keep_first] = video[:keep_first]
    masks[:keep_first] = 0.0
    if keep_last:
        control[length - keep_last:] = video[frames - keep_last:]
        masks[length - keep_last:] = 0.0
    return control, masks


def _check_single_frame(name: str, image) -> torch.Tensor:
    image = _check_image(name, image)
    if image.shape[0] != 1:
        raise ValueError(f"{name} must be one frame [1, height, width, 3], got {image.shape[0]} frames")
    return image


def first_last_frame(first: torch.Tensor, last: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First/last frame: frame 0 = first and the final frame = last (when given), mask 0 there; grey / 1 between."""
    first = _check_single_frame("first_last: first", first)
    _check_length("first_last", length)
    _, height, width, _ = first.shape
    control, masks = _grey_frames(length, height, width, device=first.device)
    control[0], masks[0] = first[0], 0.0
    if last is not None:
        last = _check_single_frame("first_last: last", last)
        if tuple(last.shape[1:3]) != (height, width):
            raise ValueError(f"first_last: last frame is {last.shape[2]}x{last.shape[1]} (width x height) but the "
                             f"first is {width}x{height}; they must match")
        if length < 2:
            raise ValueError(f"first_last: length {length} has no room for a last frame; use 5 or more")
        control[-1], masks[-1] = last[0].to(control.device), 0.0
    return control, masks


# ---------------------------------------------------------------------------------------------- references


def _reference_opacity(images: torch.Tensor, alpha) -> torch.Tensor | None:
    """Opacity [N, H, W] of each reference: the alpha mask when given, else the 4th channel, else None (opaque)."""
    count, height, width, channels = images.shape
    if alpha is None:
        return images[..., 3] if channels == 4 else None
    alpha = _check_mask("reference_images: alpha", alpha).to(images.device)
    if alpha.shape[0] not in (count, 1):
        raise ValueError(f"reference_images: alpha has {alpha.shape[0]} masks for {count} images; give {count} or 1")
    if tuple(alpha.shape[1:]) != (height, width):
        raise ValueError(f"reference_images: alpha is {alpha.shape[2]}x{alpha.shape[1]} (width x height) but the "
                         f"images are {width}x{height}; they must match")
    _check_unit_range("reference_images: alpha", alpha)
    return alpha.expand(count, height, width)


def _fit_on_white(rgb: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Resize [N, H, W, 3] to fit inside width x height keeping the aspect ratio, centred on white."""
    count, image_h, image_w, _ = rgb.shape
    scale = min(width / image_w, height / image_h)
    fit_w = min(width, max(1, round(image_w * scale)))
    fit_h = min(height, max(1, round(image_h * scale)))
    canvas = torch.ones(count, height, width, 3, dtype=torch.float32, device=rgb.device)
    top, left = (height - fit_h) // 2, (width - fit_w) // 2
    canvas[:, top:top + fit_h, left:left + fit_w] = _resize(rgb, fit_h, fit_w)
    return canvas


def reference_images(images: torch.Tensor, width: int, height: int, alpha: torch.Tensor | None = None) -> torch.Tensor:
    """Reference images [N, height, width, 3]: each composited on white and fitted (aspect kept) into the canvas.

    Opacity comes from `alpha` ([N or 1, H, W], 1 = opaque) when given, else from a 4th (RGBA) channel.
    """
    if isinstance(images, torch.Tensor) and images.ndim == 4 and images.shape[-1] not in (3, 4):
        raise ValueError(f"reference_images: images have {images.shape[-1]} channels; valid: 3 (RGB) or 4 (RGBA)")
    images = _check_image("reference_images: images", images, channels=(3, 4))
    _check_canvas("reference_images", width, height)
    _check_unit_range("reference_images: images", images)
    opacity = _reference_opacity(images, alpha)
    rgb = images[..., :3]
    if opacity is not None:
        rgb = rgb * opacity.unsqueeze(-1) + (1.0 - opacity.unsqueeze(-1))
    return _fit_on_white(rgb, width, height)


# ---------------------------------------------------------------------------------------------- control videos


def _to_uint8(frames: torch.Tensor) -> np.ndarray:
    return (frames.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8).cpu().numpy()


def _grey_uint8(frames: torch.Tensor) -> np.ndarray:
    """[F, H, W] uint8 luminance with OpenCV's RGB2GRAY (one call over all frames stacked vertically)."""
    import cv2

    count, height, width, _ = frames.shape
    stacked = _to_uint8(frames).reshape(count * height, width, 3)
    return cv2.cvtColor(stacked, cv2.COLOR_RGB2GRAY).reshape(count, height, width)


def _as_rgb(single_channel: np.ndarray) -> torch.Tensor:
    """[F, H, W] values in 0..1 -> IMAGE [F, H, W, 3] float32."""
    return torch.from_numpy(np.ascontiguousarray(single_channel, dtype=np.float32)).unsqueeze(-1).expand(
        *single_channel.shape, 3).contiguous()


def _canny_edges(frames: torch.Tensor, low_threshold: float, high_threshold: float) -> np.ndarray:
    """[F, H, W] uint8 edge maps (255 on edges) from OpenCV Canny, frame by frame."""
    import cv2

    return np.stack([cv2.Canny(grey, low_threshold, high_threshold) for grey in _grey_uint8(frames)])


def _scribble_strokes(edges: np.ndarray) -> np.ndarray:
    """Canny edges dilated into strokes about 1/256 of the short side thick each way (3 px at least)."""
    import cv2

    radius = max(1, round(min(edges.shape[1:]) / 256))
    kernel = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * radius + 1, 2 * radius + 1))
    return np.stack([cv2.dilate(frame, kernel) for frame in edges])


def _luminance(frames: torch.Tensor) -> torch.Tensor:
    weights = torch.tensor(LUMA_WEIGHTS, dtype=frames.dtype, device=frames.device)
    return (frames * weights).sum(-1, keepdim=True).expand_as(frames).contiguous()


def _dense_flow(frames: torch.Tensor) -> np.ndarray:
    """[F, H, W, 2] Farneback flow of each frame from the one before; frame 0 copies frame 1's flow (zero for a
    single frame), so the first frame shows the motion that starts there."""
    import cv2

    grey = _grey_uint8(frames)
    if len(grey) == 1:
        return np.zeros((1, *grey.shape[1:], 2), dtype=np.float32)
    flows = np.stack([cv2.calcOpticalFlowFarneback(previous, current, None, **FARNEBACK_PARAMS)
                      for previous, current in zip(grey[:-1], grey[1:])])
    return np.concatenate([flows[:1], flows])


def _flow_colours(flows: np.ndarray) -> torch.Tensor:
    """Flow [F, H, W, 2] -> IMAGE: hue = direction (0 deg = right, 90 deg = down), saturation 1,
    value = magnitude / max(largest magnitude in the video, MIN_FLOW_SCALE_PX)."""
    import cv2

    count, height, width, _ = flows.shape
    magnitude, angle = cv2.cartToPolar(flows[..., 0].reshape(count * height, width),
                                       flows[..., 1].reshape(count * height, width), angleInDegrees=True)
    value = np.clip(magnitude / max(float(magnitude.max()), MIN_FLOW_SCALE_PX), 0.0, 1.0)
    hsv = np.stack([angle, np.ones_like(value), value], axis=-1).astype(np.float32)
    rgb = cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB).reshape(count, height, width, 3)
    return torch.from_numpy(np.clip(rgb, 0.0, 1.0))


def _check_thresholds(low_threshold: float, high_threshold: float) -> None:
    if not 0 <= low_threshold <= high_threshold:
        raise ValueError(f"control: Canny thresholds need 0 <= low <= high, got low {low_threshold} and high "
                         f"{high_threshold}")


def control_from_video(video: torch.Tensor, mode: str, width: int | None = None, height: int | None = None,
                       low_threshold: float = 100, high_threshold: float = 200) -> torch.Tensor:
    """A control video [F, H', W', 3] for VACE from a video.

    Modes: "canny" (white edges on black from OpenCV Canny on the uint8 luminance), "scribble" (the Canny edges
    dilated into thick strokes), "gray" (BT.601 luminance in all 3 channels), "flow" (Farneback optical flow from
    each frame's predecessor as colour; see `_dense_flow` / `_flow_colours`), "none"/"passthrough" (frames as they
    are, e.g. depth or pose maps made by other packs). With width and height the frames are first centre-cropped to
    that aspect ratio and resized bilinearly, and the control is computed at that size.
    """
    canonical_mode = CONTROL_MODE_ALIASES.get(mode, mode)
    if canonical_mode not in CONTROL_MODES:
        valid = ", ".join(CONTROL_MODES + tuple(CONTROL_MODE_ALIASES))
        raise ValueError(f"control: unknown mode {mode!r}; valid: {valid}")
    video = _check_image("control: video", video)
    if (width is None) != (height is None):
        raise ValueError(f"control: give both width and height or neither, got width {width} and height {height}")
    if width is not None:
        _check_canvas("control", width, height)
    if canonical_mode in ("canny", "scribble"):
        _check_thresholds(low_threshold, high_threshold)
    frames = _resize_cover(video, width, height) if width is not None else video
    if canonical_mode == "none":
        return frames.clone()
    if canonical_mode == "gray":
        return _luminance(frames)
    if canonical_mode == "flow":
        return _flow_colours(_dense_flow(frames))
    edges = _canny_edges(frames, low_threshold, high_threshold)
    strokes = _scribble_strokes(edges) if canonical_mode == "scribble" else edges
    return _as_rgb(strokes / 255.0)
