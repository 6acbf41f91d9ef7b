"""`wanmesh bench real-size`: released Wan transformers at their real sizes on 1, 2 or 4 ranks: load time, memory
per rank against the rank's share of the file, one step; runs in the CLI process and the ranks it spawns.

The CLI process writes each requested file on the fly (``write_release_file``: random weights in the released
shapes and key names, one tensor in memory at a time), then for each layout spawns fresh ranks
(``common.run_world``: gloo on the CPU, one GPU per rank on CUDA) and deletes the file when done (``--keep-files``
keeps it). File kinds: ``bf16`` and ``fp8_scaled`` (ComfyUI's single file, bf16 or its scaled fp8); ``gguf_q8_0`` and
``gguf_q4_k`` (ComfyUI-GGUF's layout, written by ``tiny.gguf_write``: the matrices quantized, the small, modulation
and 5-D tensors F32; packing Q4_K in Python takes about a minute per billion values). The ranks load every kind as a
pool does by default, quantized weights kept as stored (weights "keep"). Layouts: ``world1``; ``tp2`` / ``tp4``
(each rank reads its tensor-parallel slices); ``replicas2`` (two ranks holding whole copies, as Ulysses, ring and
CFG parallel do).
Each rank reports, on Linux (``/proc/self/status``):

* ``load_s``: the loader's wall time (``weights.sharded.load_transformer_tp``, the workers' own loader);
* ``share_bytes``: its share of the file, from the header (``memory.file_slice_bytes``: sharded tensors / tp; a
  GGUF tensor-parallel slice that cuts quant blocks is read dequantized, so it holds more than its share);
* ``resident_bytes``: the model's tensor storages after the load (``worker/memory.resident_bytes``);
* ``load_peak_bytes``: the anonymous resident memory gained at the load's peak (``common.PeakAnonymousMemory``);
* ``file_pages_bytes``: the file pages the rank has mapped after the load (``RssFile`` gained): page cache,
  shared between the ranks of one machine, not the rank's own memory (none for a GGUF: closed once loaded);
* ``hwm_bytes``: the process's resident high-water mark (``VmHWM``, file pages included) after one step;
* ``step_s``: one transformer forward at ``--width x --height x --frames`` (guidance off), after one warm-up.

With ``--memory-budget-gb`` each rank also loads the file a second time with its blocks streamed from host memory
(``worker/block_streaming.py``, as a pool under that budget does; refused as the pool refuses when even streaming
cannot fit) and reports ``streamed_bytes_per_step`` (bytes copied into the device per forward),
``streamed_device_bytes`` (the most it holds on the device) and ``streamed_step_ratio``: the median over interleaved
rounds of streamed / resident step time (on the CPU the copies are memory to memory: the mechanism and the bytes;
the time is a GPU's to measure).

The targets (printed, not asserted in timed tests): resident <= 1.1 x share + 0.5 GiB, and load peak <= resident +
the file's largest tensor.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import gguf

GIB = 2**30
LAYOUTS = {"world1": (1, 1), "tp2": (2, 2), "tp4": (4, 4), "replicas2": (2, 1)}  # name: (world, tp)
GGUF_KINDS = {"gguf_q8_0": "Q8_0", "gguf_q4_k": "Q4_K"}  # kind: GGMLQuantizationType name
FILE_KINDS = ("bf16", "fp8_scaled", *GGUF_KINDS)
DEFAULT_SIZE = (64, 64, 5)  # a small latent: the step proves the model runs, the memory is the weights'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .releases import RELEASES

    parser.add_argument("--model", action="append", choices=sorted(RELEASES),
                        help="released model (repeatable; default wan21-1.3b)")
    parser.add_argument("--kind", action="append", choices=FILE_KINDS, help="file kind (repeatable; default bf16)")
    parser.add_argument("--layouts", default="world1,tp2,replicas2",
                        help=f"comma-separated, of {', '.join(LAYOUTS)} (default world1,tp2,replicas2)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                        help="compute dtype (default bf16, the GPU's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    parser.add_argument("--width", type=int, default=DEFAULT_SIZE[0])
    parser.add_argument("--height", type=int, default=DEFAULT_SIZE[1])
    parser.add_argument("--frames", type=int, default=DEFAULT_SIZE[2])
    parser.add_argument("--work", type=Path, help="folder for the written files (default: a temporary folder)")
    parser.add_argument("--keep-files", action="store_true", help="keep the written files in --work")
    parser.add_argument("--memory-budget-gb", type=float, default=0.0,
                        help="also run the model streamed block by block under this budget per rank (GB)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the streamed comparison")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")


# ------------------------------------------------------------------ the files


def release_layout(config: dict, kind: str) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(original key, stored dtype, shape) of every tensor of a released model's single safetensors file, in key
    order: bf16, or ComfyUI's scaled fp8 (block linears fp8 with a float32 ``scale_weight`` each, and the marker)."""
    from ..tiny.fp8_write import is_block_linear_weight
    from ..tiny.models import diffusers_to_original, original_transformer_names
    from ..weights.checkpoint import SCALED_FP8_MARKER, scale_key_for
    from ..weights.loaders import TRANSFORMER_CLASSES, convert_wan_transformer_keys

    model_class = TRANSFORMER_CLASSES["WanVACETransformer3DModel" if "vace_layers" in config else
                                      "WanTransformer3DModel"]
    with torch.device("meta"):
        skeleton = model_class(**config)
    names = diffusers_to_original(original_transformer_names(config), convert_wan_transformer_keys, skeleton)
    shapes = {names[name]: tuple(tensor.shape) for name, tensor in skeleton.state_dict().items()}
    entries = []
    for key in sorted(shapes):
        meta = torch.empty(shapes[key], device="meta")
        if kind == "fp8_scaled" and is_block_linear_weight(key, meta):
            entries += [(key, torch.float8_e4m3fn, shapes[key]), (scale_key_for(key), torch.float32, ())]
        else:
            entries.append((key, torch.bfloat16, shapes[key]))
    if kind == "fp8_scaled":
        entries.append((SCALED_FP8_MARKER, torch.float8_e4m3fn, (0,)))
    return sorted(entries)


def gguf_layout(config: dict, kind: str) -> list[tuple[str, gguf.GGMLQuantizationType, tuple[int, ...]]]:
    """(original key, stored GGUF type, shape) of every tensor of a released model's GGUF of ``kind``, in key order:
    the bf16 file's tensors, each stored as ``tiny.gguf_write.gguf_storage_type`` picks."""
    import gguf

    from ..tiny.gguf_write import gguf_storage_type

    target = gguf.GGMLQuantizationType[GGUF_KINDS[kind]]
    return [(key, gguf_storage_type(key, shape, target), shape) for key, _, shape in release_layout(config, "bf16")]


def layout_bytes(config: dict, kind: str) -> int:
    """The tensor data's bytes of a released model's file of ``kind`` (the header excluded)."""
    if kind in GGUF_KINDS:
        from gguf import quant_shape_to_byte_shape

        layout = gguf_layout(config, kind)
        return sum(math.prod(quant_shape_to_byte_shape(shape, stored)) for _, stored, shape in layout)
    return sum(dtype.itemsize * math.prod(shape) for _, dtype, shape in release_layout(config, kind))


def file_name(model: str, kind: str) -> str:
    return f"{model}_{kind}{'.gguf' if kind in GGUF_KINDS else '.safetensors'}"


def _drawn(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 values of tensor ``key``: drawn from a generator seeded by the key alone, so a tensor and its
    scale agree whatever order they are written in."""
    from ..tiny.models import _random_like

    return _random_like(key, torch.Size(shape), torch.Generator().manual_seed(zlib.crc32(key.encode())))


def write_release_file(config: dict, kind: str, path: Path) -> Path:
    """A released model's single file of random weights (see ``release_layout`` and ``gguf_layout``), written one
    tensor at a time."""
    if kind in GGUF_KINDS:
        return _write_gguf(config, kind, path)
    from ..tensor_files import save_tensors_streamed
    from ..tiny.fp8_write import _scaled
    from ..weights.checkpoint import SCALED_FP8_MARKER

    entries = release_layout(config, kind)
    shapes = dict((key, shape) for key, _, shape in entries)
    dtypes = dict((key, dtype) for key, dtype, _ in entries)

    def make(key: str) -> torch.Tensor:
        if key == SCALED_FP8_MARKER:
            return torch.empty(0, dtype=torch.float8_e4m3fn)
        if key.endswith(".scale_weight"):
            weight = key.removesuffix("scale_weight") + "weight"
            return _scaled(_drawn(weight, shapes[weight]), torch.float8_e4m3fn)[1]
        if dtypes[key] == torch.float8_e4m3fn:
            return _scaled(_drawn(key, shapes[key]), torch.float8_e4m3fn)[0]
        return _drawn(key, shapes[key]).to(torch.bfloat16)

    return save_tensors_streamed(entries, make, path)


def _write_gguf(config: dict, kind: str, path: Path) -> Path:
    """The GGUF of ``kind``: the bf16 file's float32 values, quantized one tensor at a time."""
    import gguf

    from ..tiny.gguf_write import write_wan_gguf_streamed

    layout = gguf_layout(config, kind)
    shapes = {key: shape for key, _, shape in layout}
    types = {key: stored for key, stored, _ in layout}
    write_wan_gguf_streamed(list(shapes.items()), lambda key: _drawn(key, shapes[key]), path,
                            gguf.GGMLQuantizationType[GGUF_KINDS[kind]], type_of=lambda key, shape: types[key])
    return path


def largest_tensor_bytes(path: Path) -> int:
    from .memory import stored_tensors

    return max(size for _, size in stored_tensors(path).values())


# ------------------------------------------------------------------ inside a rank


def _proc_status() -> dict[str, int]:
    """This process's memory lines of /proc/self/status in bytes (empty off Linux)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        name, _, rest = line.partition(":")
        if name in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            values[name] = int(rest.split()[0]) * 1024
    return values


def _rank_main(rank: int, world: int, settings: dict, result_folder: str) -> None:
    from ..weights.sharded import load_transformer_tp
    from ..worker.memory import resident_bytes
    from ..worker.residency import DTYPES
    from .common import PeakAnonymousMemory, rank_device, write_rank_result
    from .memory import _forward, _tp_group, file_slice_bytes

    device = rank_device(settings, rank)
    tp_group = _tp_group(world, settings["tp"], device)
    share = file_slice_bytes(settings["model"], settings["tp"])  # the header only; imports what loading needs
    before = _proc_status()
    started = time.perf_counter()
    with PeakAnonymousMemory() as host:
        model = load_transformer_tp(settings["model"], dtype=DTYPES[settings["dtype"]], device=device,
                                    tp_group=tp_group, weights="keep")
    load_s = time.perf_counter() - started
    loaded = _proc_status()
    forward = _forward(model, settings, device)
    forward()  # warm-up
    started = time.perf_counter()
    forward()
    step_s = time.perf_counter() - started
    after = _proc_status()
    row = {"rank": rank, "load_s": load_s, "share_bytes": share, "resident_bytes": resident_bytes(model),
           "load_peak_bytes": host.increase,
           "file_pages_bytes": loaded.get("RssFile", 0) - before.get("RssFile", 0) if loaded else None,
           "hwm_bytes": after.get("VmHWM"), "step_s": step_s}
    if settings["memory_budget_gb"] > 0:
        row.update(_streamed(model, settings, device, tp_group))
    write_rank_result(result_folder, rank, row)


def _streamed(resident, settings: dict, device: torch.device, tp_group) -> dict:
    """The same file streamed block by block under the budget, against the resident model (see the module)."""
    from ..distributed.spawn import slowest_rank_seconds
    from ..weights.sharded import load_transformer_tp
    from ..worker.block_streaming import BlockSizes, plan_streaming, stream_blocks
    from ..worker.residency import DTYPES
    from .common import time_interleaved
    from .memory import _forward, paired_ratio

    dtype = DTYPES[settings["dtype"]]
    sizes = BlockSizes.from_file(settings["model"], None, dtype, "keep", settings["tp"])
    if not plan_streaming(sizes, int(settings["memory_budget_gb"] * 1e9), Path(settings["model"]).name):
        return {"streamed_bytes_per_step": 0, "streamed_device_bytes": None, "streamed_step_ratio": None}
    model = load_transformer_tp(settings["model"], dtype=dtype, device=torch.device("cpu"), tp_group=tp_group,
                                weights="keep")
    streamer = stream_blocks(model, device)
    forwards = {"resident": _forward(resident, settings, device), "streamed": _forward(model, settings, device)}
    moved = streamer.bytes_moved
    timings = time_interleaved(forwards, device, settings["repeats"], seconds=slowest_rank_seconds)
    calls = settings["repeats"] + 1  # the warm-up too
    return {"streamed_bytes_per_step": (streamer.bytes_moved - moved) // calls,
            "streamed_device_bytes": streamer.device_bytes,
            "streamed_step_ratio": paired_ratio(timings["streamed"], timings["resident"]),
            "streamed_step_s": timings["streamed"].median, "resident_step_s": timings["resident"].median}


# ------------------------------------------------------------------ driver


def _layouts(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in LAYOUTS]
    if unknown or not names:
        raise ValueError(f"--layouts {text!r}: valid layouts are {', '.join(LAYOUTS)}")
    return names


def resolve(args: argparse.Namespace) -> dict:
    """Validated settings, checked before any file is written or process started."""
    from ..config import check_frame_count, latent_shape
    from ..distributed.tensor_parallel import check_tp_degree
    from .releases import RELEASES

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    layouts = _layouts(args.layouts)
    models = args.model or ["wan21-1.3b"]
    for name in models:
        for layout in layouts:
            check_tp_degree(RELEASES[name]["num_attention_heads"], RELEASES[name]["ffn_dim"], LAYOUTS[layout][1])
    check_frame_count(args.frames)
    if args.memory_budget_gb < 0 or args.repeats < 1:
        raise ValueError(f"--memory-budget-gb must be 0 or more and --repeats at least 1; got "
                         f"{args.memory_budget_gb} and {args.repeats}")
    if device == "cuda" and max(LAYOUTS[name][0] for name in layouts) > torch.cuda.device_count():
        raise ValueError(f"layouts {','.join(layouts)} need one GPU per rank; {torch.cuda.device_count()} visible")
    return {"models": models, "kinds": args.kind or ["bf16"], "layouts": layouts, "device": device,
            "dtype": args.dtype, "latent": latent_shape(args.width, args.height, args.frames),
            "memory_budget_gb": args.memory_budget_gb, "repeats": args.repeats}


def measure_file(path: Path, layout: str, settings: dict) -> list[dict]:
    from .common import run_world

    world, tp = LAYOUTS[layout]
    rank_settings = {"model": str(path), "tp": tp, "device": settings["device"], "dtype": settings["dtype"],
                     "latent": settings["latent"], "text_dim": 4096,
                     "memory_budget_gb": settings["memory_budget_gb"], "repeats": settings["repeats"]}
    threads = max(1, torch.get_num_threads() // world)
    rows = run_world(_rank_main, world, rank_settings, threads=threads)
    if len(rows) != world:
        raise RuntimeError(f"{world - len(rows)} of {world} ranks wrote no result")
    return rows


def targets(row: dict, largest: int) -> dict[str, bool]:
    resident_ok = row["resident_bytes"] <= 1.1 * row["share_bytes"] + 0.5 * GIB
    peak_ok = row["load_peak_bytes"] is None or row["load_peak_bytes"] <= row["resident_bytes"] + largest
    return {"resident_target": resident_ok, "peak_target": peak_ok}


def format_rows(rows: list[dict]) -> str:
    gib = lambda value: "-" if value is None else f"{value / GIB:.2f}"  # noqa: E731
    header = (f"{'model':<18} {'kind':<10} {'layout':<9} {'rank':>4} {'file GiB':>8} {'share':>6} {'resident':>8} "
              f"{'res target':>10} {'load peak':>9} {'peak target':>11} {'file pages':>10} {'VmHWM':>6} "
              f"{'load s':>6} {'read GiB/s':>10} {'step s':>7}")
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['model']:<18} {row['kind']:<10} {row['layout']:<9} {row['rank']:>4} {gib(row['file_bytes']):>8} "
            f"{gib(row['share_bytes']):>6} {gib(row['resident_bytes']):>8} "
            f"{'ok' if row['resident_target'] else 'MISS':>10} {gib(row['load_peak_bytes']):>9} "
            f"{'ok' if row['peak_target'] else 'MISS':>11} {gib(row['file_pages_bytes']):>10} "
            f"{gib(row['hwm_bytes']):>6} {row['load_s']:>6.1f} {row['share_bytes'] / GIB / row['load_s']:>10.2f} "
            f"{row['step_s']:>7.2f}")
    return "\n".join(lines)


def format_streamed(rows: list[dict], budget_gb: float) -> str:
    header = f"{'model':<18} {'kind':<10} {'layout':<9} {'rank':>4} {'on device GiB':>13} {'moved GiB/step':>14} " \
             f"{'streamed/resident step':>22}"
    lines = [f"streamed block by block under a budget of {budget_gb} GB per rank:", header, "-" * len(header)]
    for row in rows:
        ratio = "-" if row["streamed_step_ratio"] is None else f"{row['streamed_step_ratio']:.2f}"
        device = "-" if row["streamed_device_bytes"] is None else f"{row['streamed_device_bytes'] / GIB:.2f}"
        lines.append(f"{row['model']:<18} {row['kind']:<10} {row['layout']:<9} {row['rank']:>4} {device:>13} "
                     f"{row['streamed_bytes_per_step'] / GIB:>14.2f} {ratio:>22}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import tempfile

    from .releases import RELEASES

    settings = resolve(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="wanmesh-real-size-") as temporary:
        work = args.work or Path(temporary)
        for model in settings["models"]:
            for kind in settings["kinds"]:
                path = work / file_name(model, kind)
                started = time.perf_counter()
                if not path.is_file():
                    write_release_file(RELEASES[model], kind, path)
                print(f"wrote {path.name} ({path.stat().st_size / GIB:.2f} GiB) in "
                      f"{time.perf_counter() - started:.1f} s", flush=True)
                largest = largest_tensor_bytes(path)
                for layout in settings["layouts"]:
                    for row in measure_file(path, layout, settings):
                        row.update(model=model, kind=kind, layout=layout, file_bytes=path.stat().st_size,
                                   largest_tensor_bytes=largest)
                        row.update(targets(row, largest))
                        rows.append(row)
                if not args.keep_files:
                    path.unlink()
    print(format_rows(rows))
    if settings["memory_budget_gb"] > 0:
        print(format_streamed(rows, settings["memory_budget_gb"]))
    print(f"compute {settings['dtype']} on {settings['device']}, latent {list(settings['latent'])}; share: the "
          "rank's part of the file (tp-sharded tensors / tp); resident: the model's tensors; res target: resident <= "
          "1.1 x share + 0.5 GiB; load peak: anonymous memory gained while loading; peak target: <= resident + the "
          "largest tensor; file pages: the file's page cache the rank maps (shared); step s: one forward")
    if args.json:
        args.json.write_text(json.dumps({"settings": {**settings, "latent": list(settings["latent"])},
                                         "rows": rows}, indent=2))
    return 0

