"""`wanmesh bench memory`: what a transformer file costs each rank when its quantized weights stay as stored
(weights "keep") against expanding them at load ("dequantize"); runs in the CLI process and the ranks it spawns.

The CLI process checks the settings and spawns ``--world`` ranks with ``common.run_world`` (gloo on CPU, NCCL
with one GPU per rank on CUDA; one rank too, so every rank measures from a fresh process); consecutive groups of
``--tp`` ranks are the tensor-parallel groups. Each rank reports:

* ``file_slice_bytes``: its share of the file, from the header alone: each tensor the model reads at its stored
  size (safetensors: the header's data offsets; GGUF: the reader's ``n_bytes``) times 1/tp for the tensors the
  tensor-parallel plan shards (``tensor_parallel_plan(model).shard_dims()``), whole otherwise; the
  ``scale_weight`` of a scaled-fp8 layer counts whole;
* ``load_peak_bytes``: the memory the keep-mode load took at its peak. On CPU: the peak of the process's
  anonymous resident memory (``RssAnon`` in /proc/self/status, sampled every 2 ms by a thread:
  ``common.PeakAnonymousMemory``) over its value just before the load; pages of the memory-mapped file are
  page cache, not the rank's, and are not counted; a peak shorter than the sampling interval can be missed.
  On CUDA: ``torch.cuda.max_memory_allocated`` over the bytes allocated before the load;
* ``resident_bytes`` (keep) and ``resident_bytes_dequantize``: the bytes of the model's tensor storages
  (parameters and buffers, parametrization originals included), each storage counted once
  (``untyped_storage().data_ptr()``);
* ``step_s_keep`` / ``step_s_dequantize``: one transformer forward (a denoise step with guidance off) on a fixed
  latent, both models resident, called in turn after a warm-up each (``common.time_interleaved``, each call
  the slowest rank's time); the median, with the fastest and slowest call in ``*_spread``, and ``step_ratio``:
  the median over rounds of keep / dequantize within a round, which a noisy machine disturbs less.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import TEXT_TOKENS, latent_shape
from ..distributed.spawn import slowest_rank_seconds
from ..distributed.tensor_parallel import check_tp_degree, tensor_parallel_plan, tp_size_and_rank
from ..weights.checkpoint import SCALED_FP8_MARKER, read_safetensors_header, scale_key_for
from ..weights.gguf_file import is_gguf_path
from ..weights.sharded import load_transformer_tp
from ..weights.loaders import build_transformer, transformer_weight_source
from ..worker.memory import resident_bytes
from ..worker.residency import DTYPES
from .common import (PeakAnonymousMemory, Timing, mib, model_config, model_path, rank_device, run_world,
                     time_interleaved, write_rank_result)

DEFAULT_SIZE = (256, 256, 9)  # width, height, frames: latent [1, 16, 3, 32, 32]
RANK_KEYS = ("rank", "resident_bytes", "file_slice_bytes", "load_peak_bytes", "step_s_keep", "step_s_dequantize",
             "step_ratio")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Wan transformer file (.safetensors or .gguf; default: the tiny Q8_0 GGUF)")
    parser.add_argument("--models", type=Path, help="tiny models tree (default: the cache folder)")
    parser.add_argument("--world", type=int, default=1, help="ranks (processes), one GPU each on CUDA (default 1)")
    parser.add_argument("--tp", type=int, help="tensor-parallel degree, dividing --world (default: --world)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                        help="compute dtype (default bf16: the dtype the test files hold, so that resident bytes "
                             "compare with the file)")
    parser.add_argument("--width", type=int, default=DEFAULT_SIZE[0], help=f"video width (default {DEFAULT_SIZE[0]})")
    parser.add_argument("--height", type=int, default=DEFAULT_SIZE[1], help=f"video height (default {DEFAULT_SIZE[1]})")
    parser.add_argument("--frames", type=int, default=DEFAULT_SIZE[2], help=f"4k+1 frames (default {DEFAULT_SIZE[2]})")
    parser.add_argument("--steps", type=int, default=5, help="timed forwards per weights mode (default 5)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")


def resolve(args: argparse.Namespace) -> dict:
    """Validated settings, checked before any process starts."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    world, tp = args.world, args.tp or args.world
    if world < 1 or tp < 1 or world % tp:
        raise ValueError(f"--tp must divide --world (both positive); got world {world}, tp {tp}")
    if device == "cuda" and world > torch.cuda.device_count():
        raise ValueError(f"--world {world} needs one GPU per rank; {torch.cuda.device_count()} visible")
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    path = model_path(args, "model_gguf")
    config = model_config(path)
    check_tp_degree(config["num_attention_heads"], config["ffn_dim"], tp)
    return {"model": path, "kind": file_kind(path), "world": world, "tp": tp, "device": device, "dtype": args.dtype,
            "latent": latent_shape(args.width, args.height, args.frames), "text_dim": config["text_dim"],
            "steps": args.steps}


# ------------------------------------------------------------------ the file


def stored_tensors(path: str | Path) -> dict[str, tuple[str, int]]:
    """{key: (stored type, stored bytes)} of a safetensors or GGUF file, from its header (no tensor is read)."""
    if is_gguf_path(path):
        import gguf

        return {tensor.name: (tensor.tensor_type.name, int(tensor.n_bytes)) for tensor in gguf.GGUFReader(path).tensors}
    if Path(path).suffix.lower() not in (".safetensors", ".sft"):
        raise ValueError(f"{path}: bench memory reads .safetensors and .gguf files")
    header = read_safetensors_header(path)
    return {key: (entry["dtype"], entry["data_offsets"][1] - entry["data_offsets"][0])
            for key, entry in header.items() if key != "__metadata__"}


def file_kind(path: str | Path) -> str:
    """The stored type of the block linears (block 0's first FFN weight), e.g. ``Q8_0``, ``BF16``,
    ``F8_E4M3 scaled``."""
    stored = stored_tensors(path)
    ffn = next((key for key in stored if key.endswith("blocks.0.ffn.0.weight")), None)
    kind = stored[ffn][0] if ffn else "unknown"
    return f"{kind} scaled" if SCALED_FP8_MARKER in stored else kind


def file_slice_bytes(path: str, tp: int) -> int:
    """Bytes of one tensor-parallel rank's slices of the file (see the module)."""
    with contextlib.ExitStack() as stack:
        model_class, config, source = transformer_weight_source(path, None, stack)
        sharded = tensor_parallel_plan(build_transformer(model_class, config)).shard_dims()
        stored = {file: stored_tensors(file) for file in {ref.file.path for ref in source.refs.values()}}
        total = 0
        for name, ref in source.refs.items():
            sizes = stored[ref.file.path]
            share = sizes[ref.key][1] // tp if name in sharded else sizes[ref.key][1]
            total += share + sizes.get(scale_key_for(ref.key), ("", 0))[1]
        return total


# ------------------------------------------------------------------ inside a rank


def _tp_group(world: int, tp: int, device: torch.device) -> dist.ProcessGroup | None:
    """This rank's tensor-parallel group: consecutive ranks, as in the pool's mesh (None: the whole world)."""
    if tp == world:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp")).get_group("tp")


def _load(settings: dict, device: torch.device, tp_group, weights: str) -> torch.nn.Module:
    return load_transformer_tp(settings["model"], dtype=DTYPES[settings["dtype"]], device=device, tp_group=tp_group,
                               weights=weights)


def _load_measuring_peak(settings: dict, device: torch.device, tp_group) -> tuple[torch.nn.Module, int | None]:
    """The keep-mode model and the peak bytes its load took (see the module)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        model = _load(settings, device, tp_group, "keep")
        return model, torch.cuda.max_memory_allocated(device) - before
    with PeakAnonymousMemory() as host:
        model = _load(settings, device, tp_group, "keep")
    return model, host.increase


def _forward(model: torch.nn.Module, settings: dict, device: torch.device):
    """One transformer forward on fixed inputs (a denoise step with guidance off), as a function."""
    dtype = DTYPES[settings["dtype"]]
    generator = torch.Generator("cpu").manual_seed(0)
    latents = torch.randn(settings["latent"], generator=generator).to(device, dtype)
    context = torch.randn(1, TEXT_TOKENS, settings["text_dim"], generator=generator).to(device, dtype)
    timestep = torch.tensor([500.0], device=device)

    def forward() -> None:
        with torch.no_grad():
            model(hidden_states=latents, timestep=timestep, encoder_hidden_states=context, return_dict=False)
    return forward


def _measure(settings: dict, device: torch.device, tp_group) -> dict:
    tp, tp_rank = tp_size_and_rank(tp_group)
    file_slice = file_slice_bytes(settings["model"], tp)  # reads the header only; also imports what loading needs
    keep, load_peak = _load_measuring_peak(settings, device, tp_group)
    models = {"keep": keep, "dequantize": _load(settings, device, tp_group, "dequantize")}
    timings = time_interleaved({mode: _forward(model, settings, device) for mode, model in models.items()}, device,
                               settings["steps"], seconds=slowest_rank_seconds)
    row = {"rank": dist.get_rank(), "tp_rank": tp_rank, "resident_bytes": resident_bytes(keep),
           "resident_bytes_dequantize": resident_bytes(models["dequantize"]), "file_slice_bytes": file_slice,
           "load_peak_bytes": load_peak}
    for mode, timing in timings.items():
        row[f"step_s_{mode}"], row[f"step_s_{mode}_spread"] = timing.median, timing.as_list()
    row["step_ratio"] = paired_ratio(timings["keep"], timings["dequantize"])
    return row


def paired_ratio(keep: Timing, dequantize: Timing) -> float:
    """The median over rounds of keep / dequantize within each round: the two calls of a round run back to back,
    so a slow stretch of the machine hits both and drops out of their ratio."""
    return statistics.median(k / d for k, d in zip(keep.samples, dequantize.samples))


def _rank_main(rank: int, world: int, settings: dict, result_folder: str) -> None:
    device = rank_device(settings, rank)
    write_rank_result(result_folder, rank, _measure(settings, device, _tp_group(world, settings["tp"], device)))


# ------------------------------------------------------------------ driver


def measure(settings: dict) -> list[dict]:
    """Every rank's row, in rank order."""
    threads = max(1, torch.get_num_threads() // settings["world"])  # ranks share the host's cores
    rows = run_world(_rank_main, settings["world"], settings, threads=threads)
    if len(rows) != settings["world"]:
        raise RuntimeError(f"{settings['world'] - len(rows)} of {settings['world']} ranks wrote no result")
    return rows


def _ratio(numerator: float | None, denominator: float | None) -> str:
    return "-" if not numerator or not denominator else f"{numerator / denominator:.2f}"


def _seconds(row: dict, mode: str) -> str:
    low, high = row[f"step_s_{mode}_spread"]
    return f"{row[f'step_s_{mode}']:.3f} ({low:.3f}..{high:.3f})"


def format_table(settings: dict, rows: list[dict]) -> str:
    header = (f"{'rank':>4} {'resident MiB':>12} {'file slice MiB':>14} {'res/file':>8} {'load peak MiB':>13} "
              f"{'peak/res':>8} {'dequant. MiB':>12} {'keep s/step (min..max)':>24} "
              f"{'dequantize s/step (min..max)':>28} {'keep/deq':>8}")
    lines = [f"bench memory: {settings['model']} ({settings['kind']}), world {settings['world']}, tp {settings['tp']}, "
             f"{settings['device']} {settings['dtype']}, latent {list(settings['latent'])}, {settings['steps']} steps",
             header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['rank']:>4} {mib(row['resident_bytes']):>12} {mib(row['file_slice_bytes']):>14} "
            f"{_ratio(row['resident_bytes'], row['file_slice_bytes']):>8} {mib(row['load_peak_bytes']):>13} "
            f"{_ratio(row['load_peak_bytes'], row['resident_bytes']):>8} {mib(row['resident_bytes_dequantize']):>12} "
            f"{_seconds(row, 'keep'):>24} {_seconds(row, 'dequantize'):>28} "
            f"{row['step_ratio']:>8.2f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    settings = resolve(args)
    rows = measure(settings)
    print(format_table(settings, rows))
    print("resident: the keep-mode model's tensor storages; file slice: this rank's share of the file; load peak: "
          + ("CUDA memory allocated while loading" if settings["device"] == "cuda"
             else "anonymous host memory (RssAnon) gained while loading") + "; s/step: one forward, slowest rank; "
          "keep/deq: median of the per-round ratios.")
    if args.json:
        args.json.write_text(json.dumps({**settings, "latent": list(settings["latent"]), "ranks": rows}, indent=2))
    return 0
