"""`wanmesh bench lora`: how long merging, switching and removing LoRAs takes on the workers, per tp degree;
the CLI process spawns the ranks, each rank loads its shard and times the merges on its own slices.

For each tp degree: ``load`` (base -> one LoRA), ``switch`` (restore the touched layers from the model file, merge
another LoRA) and ``remove`` (restore only), each the median over repeats of the slowest rank.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.spawn import slowest_rank_median_s, spawn_ranks
from ..tiny.files import TINY_FILES, ensure_tiny_models, tiny_cache_dir
from .common import measured_runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Wan transformer file (default: the tiny built-in model)")
    parser.add_argument("--lora", action="append", help="LoRA file, twice for load and switch (default: tiny LoRAs)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel degrees to time")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the results here")


def _time_rank(rank: int, world: int, model_path: str, loras: list[str], device: str, repeats: int,
               out: str) -> None:
    from ..weights.sharded import load_transformer_tp
    from ..worker.lora_merge import apply_loras

    target = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    model = load_transformer_tp(model_path, device=target, tp_group=dist.group.WORLD)
    steps = {"load": ([], [(loras[0], 1.0)]), "switch": ([(loras[0], 1.0)], [(loras[1], 1.0)]),
             "remove": ([(loras[0], 1.0)], [])}
    results = {}
    for name, (start, end) in steps.items():
        def step(start=start, end=end):
            apply_loras(model, start, path=model_path)
            dist.barrier()
            apply_loras(model, end, path=model_path)

        def start_only(start=start):
            apply_loras(model, start, path=model_path)
            dist.barrier()

        # the timed call includes getting to the start state; subtract that part, timed alone
        results[name] = slowest_rank_median_s(step, target, repeats) - slowest_rank_median_s(start_only, target, repeats)
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def run(args) -> list[dict]:
    root = None if args.model else ensure_tiny_models(tiny_cache_dir())
    model = args.model or str(root / TINY_FILES["model"])
    loras = args.lora or [str(root / TINY_FILES["lora_comfy"]), str(root / TINY_FILES["lora_kohya"])]
    if len(loras) != 2:
        raise ValueError(f"give --lora twice (one to load, one to switch to), got {len(loras)}")
    rows, run = [], measured_runs(len(args.tp))  # a world per degree
    with tempfile.TemporaryDirectory() as folder:
        for tp in args.tp:
            run(f"tp {tp}, {args.repeats} repeats")
            out = str(Path(folder) / f"tp{tp}.json")
            spawn_ranks(_time_rank, tp, args=(model, loras, args.device, args.repeats, out), device=args.device,
                        deadline_s=600)
            times = json.loads(Path(out).read_text())
            rows.append({"tp": tp, **{f"{name}_ms": round(seconds * 1000, 2) for name, seconds in times.items()}})
            print(f"tp {tp}: " + ", ".join(f"{name} {seconds * 1000:.1f} ms" for name, seconds in times.items()))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows
