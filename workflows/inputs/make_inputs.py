"""Writes the small input media of the VACE example workflows into this folder (run by hand; no process of the pack).

Deterministic (no randomness): the same files on every run. ComfyUI's `LoadImage` reads them from its input
folder; a multi-frame (animated) PNG loads as one IMAGE batch, one tensor frame per PNG frame, in the 2024
ComfyUI and in today's alike, so the source video is an animated PNG.

    python workflows/inputs/make_inputs.py            # writes into workflows/inputs/
    python workflows/inputs/make_inputs.py OUT_DIR    # writes into OUT_DIR

Files:
* `ref_circle.png`: 64x64, a red disc on a blue background (reference image).
* `ref_texture.png`: 64x64, a green/white checkerboard square with diagonal stripes on grey (reference image).
* `source_video.png`: animated PNG, 9 frames of 64x48: a yellow square moving left to right and a magenta bar
  moving down, over a horizontal blue-to-green gradient (the source video).
"""

from __future__ import annotations

import sys
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
REFERENCE_SIZE = 64
VIDEO_WIDTH, VIDEO_HEIGHT, VIDEO_FRAMES = 64, 48, 9
FRAME_DURATION_MS = 125
SQUARE_PX = 16


def circle_reference() -> np.ndarray:
    """Red disc (radius 22) centred on a blue 64x64 image, antialiased edges; RGB uint8."""
    image = np.zeros((REFERENCE_SIZE, REFERENCE_SIZE, 3), dtype=np.uint8)
    image[:] = (30, 60, 200)
    centre = (REFERENCE_SIZE // 2, REFERENCE_SIZE // 2)
    cv2.circle(image, centre, 22, (220, 30, 30), thickness=-1, lineType=cv2.LINE_AA)
    return image


def texture_reference() -> np.ndarray:
    """A 40x40 checkerboard (8 px cells, green/white) crossed by dark diagonal stripes, centred on grey; RGB uint8."""
    size, cell, margin = 40, 8, (REFERENCE_SIZE - 40) // 2
    rows, columns = np.indices((size, size))
    checker = ((rows // cell + columns // cell) % 2).astype(bool)
    square = np.where(checker[..., None], np.array((40, 170, 60), np.uint8), np.array((245, 245, 245), np.uint8))
    stripes = ((rows + columns) % 12) < 3
    square[stripes] = (50, 40, 30)
    image = np.full((REFERENCE_SIZE, REFERENCE_SIZE, 3), 128, dtype=np.uint8)
    image[margin:margin + size, margin:margin + size] = square
    return image


def video_frames() -> np.ndarray:
    """[9, 48, 64, 3] uint8: a gradient background with a square moving right and a bar moving down."""
    columns = np.linspace(0.0, 1.0, VIDEO_WIDTH, dtype=np.float32)
    blue, green = np.array((20, 40, 180), np.float32), np.array((30, 160, 70), np.float32)
    row = (1.0 - columns[:, None]) * blue + columns[:, None] * green
    background = np.broadcast_to(row, (VIDEO_HEIGHT, VIDEO_WIDTH, 3)).round().astype(np.uint8)
    frames = np.repeat(background[None], VIDEO_FRAMES, axis=0).copy()
    for index, frame in enumerate(frames):
        x = 2 + index * (VIDEO_WIDTH - SQUARE_PX - 4) // (VIDEO_FRAMES - 1)
        cv2.rectangle(frame, (x, 16), (x + SQUARE_PX - 1, 16 + SQUARE_PX - 1), (240, 220, 30), thickness=-1)
        y = 2 + index * (VIDEO_HEIGHT - 8) // (VIDEO_FRAMES - 1)
        cv2.rectangle(frame, (44, y), (59, y + 3), (200, 40, 200), thickness=-1)
    return frames


def save_png(image: np.ndarray, path: Path) -> None:
    Image.fromarray(image, "RGB").save(path, optimize=True)


def save_animated_png(frames: np.ndarray, path: Path) -> None:
    """Every frame stored whole (no disposal or blending tricks), shown for FRAME_DURATION_MS each, looping."""
    images = [Image.fromarray(frame, "RGB") for frame in frames]
    images[0].save(path, save_all=True, append_images=images[1:], duration=FRAME_DURATION_MS, loop=0,
                   disposal=0, blend=0, optimize=True)


def read_animated_png(path: Path) -> np.ndarray:
    """The frames as Pillow reads them back (as ComfyUI's LoadImage does): [frames, H, W, 3] uint8."""
    with Image.open(path) as image:
        frames = []
        for index in range(getattr(image, "n_frames", 1)):
            image.seek(index)
            frames.append(np.asarray(image.convert("RGB")))
    return np.stack(frames)


def write_inputs(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, image in (("ref_circle.png", circle_reference()), ("ref_texture.png", texture_reference())):
        save_png(image, folder / name)
        written.append(folder / name)
    frames = video_frames()
    video_path = folder / "source_video.png"
    save_animated_png(frames, video_path)
    if not np.array_equal(read_animated_png(video_path), frames):
        raise RuntimeError(f"{video_path} does not read back as the frames written (Pillow APNG round trip)")
    written.append(video_path)
    return written


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else HERE
    for path in write_inputs(folder):
        print(f"{path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
