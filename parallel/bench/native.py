"""`wanmesh bench native-model`: ComfyUI's KSampler on the WanMesh MODEL against the WanMesh Sampler; runs in the
CLI process (with ComfyUI imported from ``--comfyui``) and the pool's workers.

Both sample the same latent with the same model, seed, sampler (euler), steps and cfg on one pool. The WanMesh
Sampler runs the whole loop in the workers (one request); ComfyUI's sampler runs the loop here and sends one
``ModelForward`` per step (conditional and unconditional rows batched), so the ratio of their step times is what
the native-sampler path costs. Interleaved rounds after a warm-up; median and spread per path; ``--json``.
This is the one benchmark that needs ComfyUI: it imports ComfyUI from ``--comfyui`` and the pack's MODEL adapter
(``nodes/bridge/pool_model.py``) by module name at run time, never at import.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

from ..config import ParallelConfig, latent_shape
from ..driver.runner import PoolRunner
from ..protocol import SampleRequest
from .common import model_config, model_path, time_interleaved


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--comfyui", type=Path, required=True, help="a ComfyUI folder (with native Wan support)")
    parser.add_argument("--model", help="transformer file (default: the tiny T2V model; the medium preset's "
                                        "from `wanmesh make-tiny DIR --preset medium` is the reference size)")
    parser.add_argument("--models", type=Path, help="a tiny models tree (default: the cache's)")
    parser.add_argument("--world", type=int, default=1, help="ranks in the pool (default 1)")
    parser.add_argument("--devices", default="auto", help="auto, cpu:N, cuda or a list such as cuda:0,cuda:1")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cfg", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up)")
    parser.add_argument("--json", type=Path, help="also write the results here")


def import_comfyui(folder: Path):
    """ComfyUI's sampling entry and the pack's MODEL adapter, imported from ``folder`` on the CPU or its GPU."""
    if not (folder / "comfy" / "samplers.py").is_file():
        raise SystemExit(f"--comfyui {folder} is not a ComfyUI folder (no comfy/samplers.py)")
    sys.path.insert(0, str(folder.resolve()))
    cli_args = importlib.import_module("comfy.cli_args")
    cli_args.args.cpu = not torch.cuda.is_available()
    sample = importlib.import_module("comfy.sample")
    pack = __package__.split(".")[0]
    bridge = f"{pack}.nodes.bridge"
    return sample, importlib.import_module(f"{bridge}.pool_model"), importlib.import_module(f"{bridge}.runtime")


def run(args: argparse.Namespace) -> list[dict]:
    comfy_sample, pool_model, runtime = import_comfyui(args.comfyui)
    path = model_path(args)
    text_dim = model_config(path)["text_dim"]
    runner = PoolRunner.for_config(ParallelConfig(world=args.world, devices=args.devices), previews=False)
    handle = runner.load_model(path)
    generator = torch.Generator().manual_seed(0)
    positive, negative = (torch.randn(512, text_dim, generator=generator) for _ in range(2))
    latent = torch.zeros(latent_shape(args.width, args.height, args.frames, 1))
    request = SampleRequest(handle=handle, latent=latent, positive=[positive], negative=[negative], seed=1,
                            steps=args.steps, guidance_scale=args.cfg, shift=8.0, sampler="euler")
    model = pool_model.pool_model(runtime.ResidentModel(runner, handle, path=path))
    noise = comfy_sample.prepare_noise(latent, 1)

    def native() -> torch.Tensor:
        return comfy_sample.sample(model, noise, args.steps, args.cfg, "euler", "simple",
                                   [[positive[None], {}]], [[negative[None], {}]], latent, disable_pbar=True)

    timings = time_interleaved({"WanMesh Sampler (loop in the workers)": lambda: runner.sample(request),
                                "KSampler on the WanMesh MODEL": native}, torch.device("cpu"), args.repeats)
    rows = [{"path": name, "step_s": t.median / args.steps, "min_step_s": t.low / args.steps,
             "max_step_s": t.high / args.steps} for name, t in timings.items()]
    base = rows[0]["step_s"]
    print(f"{args.steps} steps, {args.width}x{args.height}x{args.frames}, cfg {args.cfg}, world {args.world}, "
          f"{Path(path).name}")
    print(f"{'path':<40} {'step s (median)':>16} {'min..max':>16} {'ratio':>6}")
    for row in rows:
        row["ratio"] = row["step_s"] / base
        print(f"{row['path']:<40} {row['step_s']:>16.4f} {row['min_step_s']:>7.4f}..{row['max_step_s']:<8.4f} "
              f"{row['ratio']:>6.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows
