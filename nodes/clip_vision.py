"""CLIP vision nodes for Wan 2.1 image-to-video: load a CLIP vision file (``clip_vision_h.safetensors``) and encode
images to ComfyUI's CLIP_VISION_OUTPUT.

The encoder runs here, in the ComfyUI process, not on the worker pool: it is small (ViT-H/14, 0.6B parameters) and
sees one or two images per prompt. Its weights stay on the CPU between prompts and go to ComfyUI's text-encoder
device only for an encode, so the pool's GPUs are not held. The output is ComfyUI's own
``comfy.clip_vision.Output`` (our ``ClipVisionOutput`` without ComfyUI), so native WanImageToVideo takes it.
The loader's output is a WanMesh type: native CLIP_VISION nodes expect ComfyUI's model object, which this is not.
"""

from __future__ import annotations

import torch

LOADER_CATEGORY = "WanMesh/loaders"
ENCODE_CATEGORY = "WanMesh/image to video"
FOLDER = "clip_vision"
CROP_CHOICES = ["center", "none"]  # native CLIPVisionEncode's


def _clip_vision_files() -> list[str]:
    import folder_paths

    if FOLDER not in folder_paths.folder_names_and_paths:
        return []
    return sorted(folder_paths.get_filename_list(FOLDER))


def _clip_vision_path(name: str) -> str:
    import folder_paths

    path = folder_paths.get_full_path(FOLDER, name) if FOLDER in folder_paths.folder_names_and_paths else None
    if path is None:
        raise FileNotFoundError(f"clip_name {name!r} was not found in ComfyUI's {FOLDER!r} folder; refresh the node "
                                f"to list the files that exist")
    return path


def _encode_device() -> torch.device:
    """Where native CLIPVisionEncode would run (ComfyUI's text-encoder device); the CPU without ComfyUI."""
    try:
        from comfy.model_management import text_encoder_device
    except ImportError:
        return torch.device("cpu")
    return text_encoder_device()


def comfy_output(output):
    """``output`` as ComfyUI's ``comfy.clip_vision.Output`` when ComfyUI is importable, else unchanged."""
    try:
        from comfy.clip_vision import Output
    except ImportError:
        return output
    native = Output()
    for name, value in output.items():
        native[name] = value
    return native


class WanMeshCLIPVisionLoader:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"clip_name": (_clip_vision_files(), {"tooltip": "CLIP vision file from ComfyUI's "
                                           "clip_vision folder: clip_vision_h.safetensors for Wan 2.1 image-to-video "
                                           "(transformers or OpenCLIP key names)"})}}

    RETURN_TYPES = ("WANMESH_CLIP_VISION",)
    FUNCTION = "load"
    CATEGORY = LOADER_CATEGORY
    DESCRIPTION = ("Loads a CLIP vision image encoder (clip_vision_h for Wan 2.1 image-to-video) in this ComfyUI "
                   "process, float32 on the CPU; for WanMesh CLIP Vision Encode.")

    def load(self, clip_name):
        from ..parallel.weights.clip_vision_files import load_clip_vision

        return (load_clip_vision(_clip_vision_path(clip_name), torch.float32, "cpu"),)


class WanMeshCLIPVisionEncode:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "clip_vision": ("WANMESH_CLIP_VISION", {"tooltip": "the loaded CLIP vision encoder"}),
            "image": ("IMAGE", {"tooltip": "the image(s) to encode, e.g. the start frame; resized to the encoder's "
                                           "224 px as native CLIPVisionEncode does"}),
            "crop": (CROP_CHOICES, {"tooltip": "center: short side to 224 px, then the centre square (native's "
                                               "default); none: the whole image squeezed to 224x224"}),
        }}

    RETURN_TYPES = ("CLIP_VISION_OUTPUT",)
    FUNCTION = "encode"
    CATEGORY = ENCODE_CATEGORY
    DESCRIPTION = ("Encodes images with the CLIP vision encoder in this ComfyUI process, exactly as native "
                   "CLIPVisionEncode; the output goes to WanImageToVideo's clip_vision_output.")

    def encode(self, clip_vision, image, crop="center"):
        from ..parallel.networks.clip_vision import encode_images

        clip_vision.to(_encode_device())
        try:
            output = encode_images(clip_vision, image, crop=crop == "center")  # as native: anything else stretches
        finally:
            clip_vision.to("cpu")
        return (comfy_output(output),)


_NODES = {
    "WanMeshCLIPVisionLoader": (WanMeshCLIPVisionLoader, "WanMesh CLIP Vision Loader"),
    "WanMeshCLIPVisionEncode": (WanMeshCLIPVisionEncode, "WanMesh CLIP Vision Encode"),
}
NODE_CLASS_MAPPINGS = {node_id: cls for node_id, (cls, _) in _NODES.items()}
NODE_DISPLAY_NAME_MAPPINGS = {node_id: name for node_id, (_, name) in _NODES.items()}
