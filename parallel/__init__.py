"""WanMesh's engine and the small public API the ComfyUI nodes and the command line use. Never imports ComfyUI.

Importing this package is light (torch and the standard library; no diffusers or transformers): ComfyUI
imports the pack at start-up. Model libraries load in the workers, or when a command needs them.

Processes: ``driver/`` runs in the ComfyUI or CLI process, ``worker/`` in each worker process,
``distributed/``, ``models/`` and ``sampling/`` in the workers; ``config``, ``protocol``, ``errors`` and
``transport`` are shared by both sides. See ARCHITECTURE.md.
"""

from .config import (
    BACKENDS,
    DTYPE_NAMES,
    SAMPLERS,
    ParallelConfig,
    check_video_size,
    latent_shape,
    parse_stream_timesteps,
)
from .driver.runner import PoolRunner
from .errors import Cancelled, WorkerError
from .models.detect import safetensors_kind
from .config import LORA_STRENGTH_RANGE
from .models.lora import check_lora_for_model, model_files_of_handle
from .pool_memory import stop_pool, unload_pool_models
from .tensor_files import save_tensors_atomic
from .validation import check_model_file, check_ranks
from .protocol import EncodeVace, SampleRequest, StreamSample
from .video_io import H264_ENCODERS, read_video, video_encoder, write_video

__all__ = [
    "BACKENDS", "DTYPE_NAMES", "SAMPLERS", "ParallelConfig", "check_video_size", "latent_shape",
    "PoolRunner", "Cancelled", "WorkerError", "SampleRequest", "EncodeVace", "safetensors_kind",
    "H264_ENCODERS", "read_video", "video_encoder", "write_video",
    "LORA_STRENGTH_RANGE", "check_lora_for_model", "model_files_of_handle",
    "StreamSample", "parse_stream_timesteps",
    "stop_pool", "unload_pool_models", "save_tensors_atomic", "check_ranks", "check_model_file",
]
