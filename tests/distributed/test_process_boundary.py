"""The process boundary: which WanMesh modules and heavy libraries each side loads.

The ComfyUI side imports the pack and reads its node mappings, as ComfyUI does at start-up: nodes, the driver and
the header checks, never a model library. A worker of a real pool loads its loop, the protocol, the transport and
the model code it will run when it starts (so an idle worker already holds what sampling imports), and never the
nodes, the driver, the validation or the command line, even after loading a model and sampling.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import torch

from pool_helpers import cpu_pool, random_prompt_request, tiny_model_paths
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.protocol import Diagnostic

MODEL_LIBRARIES = ("diffusers", "transformers", "accelerate", "sentencepiece", "cv2", "av", "ray", "matplotlib")
COMFYUI_SIDE = {
    "nodes", "nodes.cache", "nodes.clip_vision", "nodes.image_to_video", "nodes.loaders", "nodes.lora",
    "nodes.native_model", "nodes.pool", "nodes.sampling", "nodes.stream", "nodes.ti2v", "nodes.vace",
    "nodes.vace_builders", "nodes.vae", "nodes.video",
    "nodes.bridge", "nodes.bridge.conditioning_keys", "nodes.bridge.convert", "nodes.bridge.errors",
    "nodes.bridge.files", "nodes.bridge.input_checks", "nodes.bridge.live_streams", "nodes.bridge.memory",
    "nodes.bridge.pool_model",
    "nodes.bridge.pool_patches", "nodes.bridge.prompt_checks", "nodes.bridge.runtime", "nodes.bridge.shutdown",
    "parallel", "parallel.auto_layout", "parallel.cache_settings", "parallel.config", "parallel.errors", "parallel.fields",
    "parallel.image_to_video", "parallel.protocol",
    "parallel.pool_memory",
    "parallel.driver", "parallel.driver.live_prompts", "parallel.driver.pool", "parallel.driver.runner",
    "parallel.driver.timings", "parallel.driver.worker_template",
    "parallel.validation", "parallel.video_io",
    "parallel.vace", "parallel.vace.builders", "parallel.vace.encode",
    "parallel.weights", "parallel.weights.checkpoint", "parallel.weights.detect", "parallel.weights.gguf_file",
    "parallel.weights.lora_files", "parallel.weights.quantized", "parallel.weights.vae22_keys",
}
WORKER_LOOP = {"parallel", "parallel.cache_settings", "parallel.config", "parallel.errors", "parallel.protocol",
               "parallel.transport",
               "parallel.distributed", "parallel.distributed.mesh", "parallel.worker", "parallel.worker.main",
               "parallel.worker.session",
               "parallel.worker.runtime"}
# What a worker imports when it starts (WorkerRuntime.preload_model_code), besides its loop.
WORKER_MODEL_CODE = {"parallel.worker.executors", "parallel.worker.residency", "parallel.worker.lora_merge",
                     "parallel.worker.block_streaming",
                     "parallel.weights.loaders", "parallel.weights.umt5_files", "parallel.networks.umt5",
                     "parallel.sampling.loop"}
NEVER_IN_A_WORKER = ("nodes", "parallel.driver", "parallel.validation", "parallel.cli", "parallel.bench",
                     "parallel.tiny", "parallel.pool_memory", "parallel.fields")

COMFYUI_IMPORT = """
import json, sys
import wanmesh
assert wanmesh.NODE_CLASS_MAPPINGS  # what ComfyUI reads right after importing a pack
print(json.dumps(sorted(sys.modules)))
"""


def _wanmesh_modules(modules: list[str]) -> set[str]:
    return {name.removeprefix("wanmesh.") for name in modules if name.startswith("wanmesh.")}


def test_comfyui_side_loads_nodes_and_driver_but_no_model_library():
    result = subprocess.run([sys.executable, "-c", COMFYUI_IMPORT], capture_output=True, text=True, timeout=120,
                            check=True)
    modules = json.loads(result.stdout.strip().splitlines()[-1])
    loaded = _wanmesh_modules(modules)
    assert loaded <= COMFYUI_SIDE, f"unexpected on the ComfyUI side: {sorted(loaded - COMFYUI_SIDE)}"
    assert {"nodes.sampling", "parallel.driver.runner"} <= loaded
    assert not [name for name in MODEL_LIBRARIES if name in modules], "a model library loads at ComfyUI start-up"


def test_a_worker_loads_neither_nodes_nor_driver(tmp_path):
    paths = tiny_model_paths(tmp_path)
    with cpu_pool(world=1) as pool:
        idle = pool.call(Diagnostic("modules")).info["modules"]
        runner = PoolRunner(pool)
        request = random_prompt_request(torch.zeros(1, 16, 2, 8, 8), torch.Generator().manual_seed(1), seed=1,
                                        steps=2, guidance_scale=1.0, shift=3.0)
        runner.sample(replace(request, handle=runner.load_model(paths["t2v_gguf_q8_0"])))
        working = pool.call(Diagnostic("modules")).info["modules"]
    loaded_idle = _wanmesh_modules(idle)
    assert WORKER_LOOP | WORKER_MODEL_CODE <= loaded_idle, sorted(WORKER_LOOP | WORKER_MODEL_CODE - loaded_idle)
    assert {"diffusers", "transformers"} <= set(idle)  # the model libraries load when the worker starts
    loaded = _wanmesh_modules(working)
    assert {"parallel.weights.quantized", "parallel.weights.dequant", "parallel.sampling.loop"} <= loaded
    # Sampling a text-to-video prompt needs no module beyond those the worker started with and the GGUF reader.
    assert {name for name in loaded - loaded_idle if not name.startswith("parallel.weights.")} == set(), \
        sorted(loaded - loaded_idle)
    for modules in (idle, working):
        wrong = sorted(name for name in _wanmesh_modules(modules) if name.startswith(NEVER_IN_A_WORKER))
        assert not wrong, f"driver-side modules in a worker: {wrong}"
