"""WanMesh's engine and the small public API the ComfyUI nodes and the command line use. Never imports ComfyUI.

The API loads lazily (PEP 562): ``from wanmesh.parallel import PoolRunner`` imports the driver, while a worker,
which imports this package on its way to ``worker/``, loads none of it. Nothing here imports diffusers or
transformers: model libraries load in the workers, or when a command needs them.

Processes: ``driver/`` runs in the ComfyUI or CLI process, ``worker/`` in each worker process,
``distributed/``, ``models/`` and ``sampling/`` in the workers; ``config``, ``protocol``, ``errors`` and
``transport`` are shared by both sides. See ARCHITECTURE.md.
"""

from __future__ import annotations

import importlib

# public name -> the module (relative to this package) that defines it
_EXPORTS = {
    **dict.fromkeys(("BACKENDS", "DTYPE_NAMES", "I2V_EXPERT_BOUNDARY", "LORA_STRENGTH_RANGE", "MAX_SEED", "SAMPLERS",
                     "SCHEDULERS", "COMFY_SAMPLERS",
                     "T2V_EXPERT_BOUNDARY", "TEXT_TOKENS", "WEIGHT_MODES", "ParallelConfig", "check_encode_frames",
                     "check_video_size",
                     "latent_shape", "parse_stream_timesteps"), "config"),
    "PoolRunner": "driver.runner",
    **dict.fromkeys(("Cancelled", "WorkerError"), "errors"),
    "safetensors_kind": "weights.detect",
    "check_lora_for_model": "weights.lora_files",
    **dict.fromkeys(("stop_pool", "unload_pool_models"), "pool_memory"),
    "save_tensors_atomic": "tensor_files",
    **dict.fromkeys(("check_model_file", "check_ranks", "has_vace_blocks", "model_image_inputs"), "validation"),
    **dict.fromkeys(("EncodeVace", "ModelForward", "SampleRequest", "StreamSample"), "protocol"),
    **dict.fromkeys(("H264_ENCODERS", "read_video", "video_encoder", "write_video"), "video_io"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
