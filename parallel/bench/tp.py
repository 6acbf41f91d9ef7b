"""`wanmesh bench tp`: tensor parallelism measured per degree: traffic, time per step and weight memory;
runs in the CLI process and the ranks it spawns.

For each degree a local world is spawned (gloo on CPU, NCCL with one GPU per rank on CUDA); every rank
loads its shard with sharded loading and reports:

* the bytes each collective moved in one forward, counted by ``CollectiveCounter``, beside the plan's
  analytic count (``analytic_collectives``);
* the time of one CFG denoise step (two forward passes and the guidance mix; slowest rank, median);
* its weight memory: parameter bytes (sharded / replicated), the peak anonymous host memory while loading,
  and on CUDA the peak device memory after loading.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..config import TEXT_TOKENS
import torch.distributed as dist

from ..distributed.collectives import CollectiveCounter
from ..weights.sharded import load_transformer_tp, weight_bytes
from ..distributed.tensor_parallel import analytic_collectives, check_tp_degree
from ..distributed.spawn import slowest_rank_median_s
from .common import (PeakAnonymousMemory, check_repeats, int_list, measured_runs, mib, model_config, model_path,
                     rank_device, run_world, write_rank_result)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DEFAULT_SIZE = {"tiny": (128, 96, 17), "real": (832, 480, 81)}  # width, height, frames


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel degrees (default 1,2)")
    parser.add_argument("--model", help="Wan T2V or VACE transformer file/folder (default: the tiny built-in T2V)")
    parser.add_argument("--vace-module", help="VACE module file merged onto --model")
    parser.add_argument("--models", type=Path, help="tiny models tree (default: the cache folder)")
    parser.add_argument("--width", type=int, help="video width (default 128 tiny, 832 real)")
    parser.add_argument("--height", type=int, help="video height (default 96 tiny, 480 real)")
    parser.add_argument("--frames", type=int, help="4k+1 frames (default 17 tiny, 81 real)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="default fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per degree (median is reported)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")


def _video_size(args: argparse.Namespace) -> tuple[int, int, int]:
    default = _DEFAULT_SIZE["real" if args.model else "tiny"]
    width, height, frames = (args.width or default[0], args.height or default[1], args.frames or default[2])
    if width % 16 or height % 16 or frames % 4 != 1:
        raise ValueError(f"width and height must be multiples of 16 and frames 4k+1; got {width}x{height}, {frames} frames")
    return width, height, frames


def resolve(args: argparse.Namespace) -> dict:
    """Validated settings, checked before any process starts."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    degrees = int_list(args.tp, "--tp")
    path = model_path(args)
    config = model_config(path, args.vace_module)
    for tp in degrees:
        check_tp_degree(config["num_attention_heads"], config["ffn_dim"], tp)
    if device == "cuda" and max(degrees) > torch.cuda.device_count():
        raise ValueError(f"--tp {max(degrees)} needs one GPU per rank; {torch.cuda.device_count()} visible")
    check_repeats(args.repeats)
    width, height, frames = _video_size(args)
    patch = config["patch_size"]
    latent = (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
    return {
        "device": device, "degrees": degrees, "model": path, "vace_module": args.vace_module,
        "dtype": args.dtype or ("bf16" if device == "cuda" else "fp32"), "repeats": args.repeats,
        "latent": latent, "video_tokens": latent[2] // patch[0] * (latent[3] // patch[1]) * (latent[4] // patch[2]),
        "num_blocks": config["num_layers"] + len(config.get("vace_layers") or ()),
        "dim": config["num_attention_heads"] * config["attention_head_dim"], "text_dim": config["text_dim"],
        "vace": bool(config.get("vace_layers")), "vace_channels": config.get("vace_in_channels"),
    }


# ------------------------------------------------------------------ inside a rank


def _inputs(settings: dict, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    generator = torch.Generator("cpu").manual_seed(0)
    latents = torch.randn(settings["latent"], generator=generator).to(device, dtype)
    context = torch.randn(2, TEXT_TOKENS, settings["text_dim"], generator=generator).to(device, dtype)
    extra = {}
    if settings["vace"]:
        control = torch.randn(1, settings["vace_channels"], *settings["latent"][2:], generator=generator)
        extra["control_hidden_states"] = control.to(device, dtype)
    return latents, context[:1], context[1:], extra


def _measure(settings: dict, device: torch.device) -> dict:
    from ..sampling.guidance import guided_prediction

    dtype = _DTYPES[settings["dtype"]]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with PeakAnonymousMemory() as host:
        model = load_transformer_tp(settings["model"], vace_module=settings["vace_module"], dtype=dtype,
                                    device=device, tp_group=None)
    device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    latents, positive, negative, extra = _inputs(settings, device, dtype)
    timestep = torch.tensor([500.0], device=device)
    with torch.no_grad(), CollectiveCounter() as counter:
        model(hidden_states=latents, timestep=timestep, encoder_hidden_states=positive, return_dict=False, **extra)
    tp = dist.get_world_size()
    analytic = analytic_collectives(
        num_blocks=settings["num_blocks"], batch=1, video_tokens=settings["video_tokens"], text_tokens=TEXT_TOKENS,
        dim=settings["dim"], tp=tp, activation_bytes=torch.finfo(dtype).bits // 8,
    )
    with torch.no_grad():
        step_s = slowest_rank_median_s(
            lambda: guided_prediction(model, latents, timestep[0], positive, negative, 5.0, extra), device,
            settings["repeats"])
    return {"tp": tp, "rank": dist.get_rank(), "collectives": counter.as_dict(), "analytic": analytic,
            "step_s": step_s, "weights": weight_bytes(model), "host_peak_bytes": host.increase,
            "device_peak_bytes": device_peak}


def _rank_main(rank: int, world: int, settings: dict, result_folder: str) -> None:
    write_rank_result(result_folder, rank, _measure(settings, rank_device(settings, rank)))


# ------------------------------------------------------------------ driver


def _run_world(tp: int, settings: dict) -> list[dict]:
    threads = max(1, torch.get_num_threads() // tp)  # ranks share the host's cores
    return run_world(_rank_main, tp, settings, threads=threads)


def format_table(rows: list[dict]) -> str:
    header = (f"{'tp':>3} {'rank':>4} {'s/step':>9} {'all_reduce':>10} {'MiB sent':>9} {'analytic':>9} "
              f"{'weights MiB':>11} {'sharded':>8} {'replic.':>8} {'host peak':>9} {'dev peak':>9}")
    lines = [header, "-" * len(header)]
    for row in rows:
        counted = row["collectives"].get("all_reduce", {"calls": 0, "sent": 0})
        weights = row["weights"]
        lines.append(
            f"{row['tp']:>3} {row['rank']:>4} {row['step_s']:>9.4f} {counted['calls']:>10} {mib(counted['sent']):>9} "
            f"{mib(row['analytic']['sent_bytes']):>9} {mib(weights['total']):>11} {mib(weights['sharded']):>8} "
            f"{mib(weights['replicated']):>8} {mib(row['host_peak_bytes']):>9} {mib(row['device_peak_bytes']):>9}"
        )
    other_ops = sorted({op for row in rows for op in row["collectives"] if op != "all_reduce"})
    if other_ops:
        lines.append(f"other collectives seen: {', '.join(other_ops)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    settings = resolve(args)
    run = measured_runs(len(settings["degrees"]))  # a world per degree
    latent = "x".join(str(size) for size in settings["latent"][2:])
    rows = []
    for tp in settings["degrees"]:
        run(f"tp {tp}, latent {latent}, {settings['repeats']} timed step{'s' * (settings['repeats'] != 1)}")
        rows += _run_world(tp, settings)
    print(f"wanmesh bench tp: {settings['model']}, {settings['device']} {settings['dtype']}, latent "
          f"{list(settings['latent'])} ({settings['video_tokens']} tokens), {settings['num_blocks']} blocks, CFG step")
    print(format_table(rows))
    print("MiB sent: counted by CollectiveCounter in one forward (ring all-reduce volume per rank); analytic: the "
          "plan's count. host peak: anonymous host memory while loading; dev peak: CUDA memory after loading.")
    if args.json:
        args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    return 0
