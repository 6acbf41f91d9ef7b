"""ComfyUI nodes of WanMesh: thin wrappers that convert ComfyUI types and call the engine."""

from .bridge import errors, input_checks, live_streams, memory, shutdown
from .pool import WanMeshPool
from .cache import WanMeshCache
from .loaders import WanMeshModelLoader, WanMeshTextEncoderLoader, WanMeshVAELoader
from .lora import WanMeshLoraLoader
from .clip_vision import WanMeshCLIPVisionEncode, WanMeshCLIPVisionLoader
from .image_to_video import WanMeshImageToVideo
from .ti2v import WanMeshWan22ImageToVideoLatent
from .native_model import WanMeshNativeModel
from .sampling import WanMeshEmptyLatent, WanMeshSampler, WanMeshTextEncode
from .stream import WanMeshPromptSwitch, WanMeshStreamSampler
from .vace import WanMeshTrimLatent, WanMeshVaceEncode
from .vace_builders import WanMeshVaceControl, WanMeshVaceMask, WanMeshVaceReference
from .vae import WanMeshVAEDecode, WanMeshVAEEncode
from .video import WanMeshSaveVideo

_NODES = {
    "WanMeshPool": (WanMeshPool, "WanMesh Pool"),
    "WanMeshModelLoader": (WanMeshModelLoader, "WanMesh Model Loader"),
    "WanMeshVAELoader": (WanMeshVAELoader, "WanMesh VAE Loader"),
    "WanMeshLoraLoader": (WanMeshLoraLoader, "WanMesh LoRA Loader"),
    "WanMeshNativeModel": (WanMeshNativeModel, "WanMesh Native Model"),
    "WanMeshTextEncoderLoader": (WanMeshTextEncoderLoader, "WanMesh Text Encoder Loader"),
    "WanMeshTextEncode": (WanMeshTextEncode, "WanMesh Text Encode"),
    "WanMeshEmptyLatent": (WanMeshEmptyLatent, "WanMesh Empty Latent"),
    "WanMeshSampler": (WanMeshSampler, "WanMesh Sampler"),
    "WanMeshCache": (WanMeshCache, "WanMesh Cache"),
    "WanMeshStreamSampler": (WanMeshStreamSampler, "WanMesh Stream Sampler"),
    "WanMeshPromptSwitch": (WanMeshPromptSwitch, "WanMesh Prompt Switch"),
    "WanMeshVAEDecode": (WanMeshVAEDecode, "WanMesh VAE Decode"),
    "WanMeshVAEEncode": (WanMeshVAEEncode, "WanMesh VAE Encode"),
    "WanMeshVaceEncode": (WanMeshVaceEncode, "WanMesh VACE Encode"),
    "WanMeshImageToVideo": (WanMeshImageToVideo, "WanMesh Image To Video"),
    "WanMeshWan22ImageToVideoLatent": (WanMeshWan22ImageToVideoLatent, "WanMesh Wan22 Image To Video Latent"),
    "WanMeshCLIPVisionLoader": (WanMeshCLIPVisionLoader, "WanMesh CLIP Vision Loader"),
    "WanMeshCLIPVisionEncode": (WanMeshCLIPVisionEncode, "WanMesh CLIP Vision Encode"),
    "WanMeshTrimLatent": (WanMeshTrimLatent, "WanMesh Trim Latent"),
    "WanMeshVaceMask": (WanMeshVaceMask, "WanMesh VACE Mask"),
    "WanMeshVaceReference": (WanMeshVaceReference, "WanMesh VACE Reference"),
    "WanMeshVaceControl": (WanMeshVaceControl, "WanMesh VACE Control"),
    "WanMeshSaveVideo": (WanMeshSaveVideo, "WanMesh Save Video"),
}

NODE_CLASS_MAPPINGS = {node_id: cls for node_id, (cls, _) in _NODES.items()}
NODE_DISPLAY_NAME_MAPPINGS = {node_id: name for node_id, (_, name) in _NODES.items()}

errors.install(NODE_CLASS_MAPPINGS)  # worker failures show as one line with a short exception name
input_checks.install(NODE_CLASS_MAPPINGS)  # bad widget values: /prompt answers 400 naming the field
memory.install()  # ComfyUI's "unload models" / "free memory" reach the worker pool
live_streams.install()  # POST /wanmesh/stream/<prompt id>/prompt: a new prompt for a running stream
shutdown.install()  # Ctrl-C during a prompt: the pool call stops first, then the interpreter ends
