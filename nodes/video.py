"""Save-video node: writes IMAGE frames as an H.264 MP4 into ComfyUI's output folder and shows it in the UI.

The file is named like SaveImage's (`<prefix>_<counter:05>_.mp4`, subfolders from the prefix) and written
atomically by `parallel/video_io.py`. The UI result has the shape of ComfyUI's own SaveVideo
(`ui.PreviewVideo`: "images" entries plus "animated"), which today's frontend plays in a <video> element.
"""

from __future__ import annotations

import os

from ..parallel import write_video
from ..parallel.fields import node_input


class WanMeshSaveVideo:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "images": ("IMAGE", {"tooltip": "the frames to save, e.g. from a VAE decode"}),
            "fps": node_input("fps"),
            "filename_prefix": ("STRING", {"default": "WanMesh",
                                           "tooltip": "file name start; may hold subfolders (video/WanMesh) "
                                                      "and %width% / %height%"}),
        }}

    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True
    CATEGORY = "WanMesh/video"
    DESCRIPTION = ("Saves the frames as an H.264 MP4 in ComfyUI's output folder (written to a temporary file, "
                   "checked, then renamed, so no half-written video is left) and shows it in the UI.")

    def save(self, images, fps, filename_prefix="WanMesh"):
        import folder_paths  # ComfyUI's module: only there when ComfyUI runs this node

        if images.ndim != 4:
            raise ValueError(f"images must be an IMAGE [frames, height, width, 3], got {list(images.shape)}")
        height, width = int(images.shape[1]), int(images.shape[2])
        folder, name, counter, subfolder, _ = folder_paths.get_save_image_path(
            filename_prefix, folder_paths.get_output_directory(), width, height)
        filename = f"{name}_{counter:05}_.mp4"
        write_video(images, os.path.join(folder, filename), fps)
        # Exactly what ComfyUI's own SaveVideo / SaveWEBM send (ui.PreviewVideo of one SavedResult): the
        # frontend plays an "animated" result whose file is a video in a <video> element on the node.
        saved = {"filename": filename, "subfolder": subfolder, "type": "output"}
        return {"ui": {"images": [saved], "animated": (True,)}}
