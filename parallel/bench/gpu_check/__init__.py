"""`wanmesh bench gpu` (and `tests/gpu/run.sh`): the CUDA path proven and measured on one GPU in one run; runs in
the CLI process and, for the two-rank check, in two ranks it spawns on the same device.

Correctness checks (each against a stated tolerance, written to the report with the error it found):

* ``cuda_tests``: the test suite's CUDA-only tests (GGUF dequantisation on the device), run by pytest;
* ``world1_vs_cpu``: the T2V transformer of the tiny and medium presets loaded on the device, fp32 (TF32 off) and
  bf16, against the CPU fp32 forward; the medium preset's scaled fp8, Q8_0 and Q4_K files kept quantized on the
  device against the same files dequantized on the CPU;
* ``attention_backends``: every local attention backend (``distributed/attention.py``) the device runs, output
  and log-sum-exp, against ``math`` in float32, with and without key padding;
* ``quantized_layers``: fp8, scaled fp8, GGUF Q8_0 and Q4_K linears kept as stored on the device against their
  CPU dequantisation (the weight bit for bit, the output within fp32 rounding);
* ``vae_decode``: the Wan 2.1 and 2.2 VAE decodes on the device against the CPU;
* ``two_ranks``: two ranks on one device (NCCL if it accepts two ranks on one GPU, else gloo over device tensors:
  the report says which) running tp 2 and ulysses 2, each against world 1.

Measurements (random bf16 weights, one warm-up call each and interleaved rounds: median, fastest, slowest): the
transformer forward of WanMesh world 1 (the loader's input hooks), WanMesh's attention seam (the context-parallel
processor at degree 1) and diffusers' WanTransformer3DModel at the Wan 2.1 1.3B shape and a slice of the 14B shape
at the 480p and 720p x 81 frames token counts: time, peak memory against the cost model's prediction, achieved
TFLOP/s (``auto_layout.block_flops``) against the device's bf16 peak, the attention share; kept fp8 and Q4_K
against bf16; loading the same model folder with WanMesh's loader and with diffusers' ``from_pretrained``;
``torch.compile`` on and off; the VAE decode time per frame at 480p. The targets are printed as pass
or miss, never failing the run.

Every section has its own time budget (an alarm interrupts it) and its own try/except; a global deadline skips the
sections left and says so. ``--dry-run`` runs everything on the CPU at the smallest sizes (what CI runs). The report
goes to ``gpu_report.json`` and ``gpu_report.md`` in ``--out``.

Modules: ``harness`` (sizes, tolerances, a section's run under its budget, the shared model files), ``checks``,
``two_ranks``, ``sampling`` (the half-precision sampling section), ``measurements`` and ``report`` (targets and
the Markdown report); this one holds the section tables and the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .checks import (
    check_attention_backends,
    check_cuda_tests,
    check_quantized_layers,
    check_vae_decode,
    check_world1_vs_cpu,
)
from .harness import (
    ATTENTION_TOLERANCE,
    BF16_TOLERANCE,
    DEFAULT_DEADLINE_S,
    EXIT_NO_CUDA,
    FP32_TOLERANCE,
    GPU_SIZES,
    PARALLEL_TOLERANCE,
    REPO_ROOT,
    Run,
    dry_run_sizes,
    run_section,
)
from .measurements import (
    bf16_peak_tflops,
    measure_compile,
    measure_load,
    measure_quantized_step,
    measure_transformer_step,
    measure_vae_decode,
)
from .report import evaluate_targets, markdown
from .sampling import check_half_precision_sampling
from .two_ranks import check_two_ranks


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _device_info(device: torch.device) -> dict:
    info = {"type": device.type, "torch": torch.__version__, "cuda": torch.version.cuda, "name": "CPU",
            "python": sys.version.split()[0]}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(name=properties.name, capability=list(torch.cuda.get_device_capability(device)),
                    memory_bytes=properties.total_memory, bf16_peak_tflops=bf16_peak_tflops(device))
    for package in ("diffusers", "gguf", "transformers", "flash_attn", "av"):
        try:
            from importlib.metadata import version

            info[package] = version(package.replace("_", "-"))
        except Exception:  # noqa: BLE001 - not installed
            info[package] = None
    return info


CHECKS = (("cuda_tests", 90, check_cuda_tests), ("world1_vs_cpu", 75, check_world1_vs_cpu),
          ("attention_backends", 30, check_attention_backends), ("quantized_layers", 30, check_quantized_layers),
          ("vae_decode", 40, check_vae_decode), ("two_ranks", 90, check_two_ranks),
          ("half_precision_sampling", 60, check_half_precision_sampling))
MEASUREMENTS = (("transformer_step", 150, measure_transformer_step), ("quantized_step", 60, measure_quantized_step),
                ("load_time", 30, measure_load), ("vae_decode_time", 40, measure_vae_decode),
                ("torch_compile", 100, measure_compile))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="run every section on the CPU at the smallest sizes "
                        "(what CI runs; its numbers say nothing about a GPU)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/gpu-check"), help="folder for gpu_report.json "
                        "and gpu_report.md (default bench-out/gpu-check; tests/gpu/run.sh passes $OUT when set)")
    parser.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                        help=f"seconds after which no section starts (default {DEFAULT_DEADLINE_S:.0f})")
    parser.add_argument("--only", help="comma-separated section names to run (default: all)")


def run(args: argparse.Namespace) -> int:
    if not args.dry_run and not torch.cuda.is_available():
        print("wanmesh bench gpu: no CUDA device is visible; run on a machine with a GPU, or pass --dry-run",
              file=sys.stderr)
        return EXIT_NO_CUDA
    if args.deadline <= 0:
        raise ValueError(f"--deadline must be positive seconds, got {args.deadline}")
    sections = CHECKS + MEASUREMENTS
    only = None if not args.only else {name.strip() for name in args.only.split(",") if name.strip()}
    if only and only - {name for name, _, _ in sections}:
        raise ValueError(f"--only {args.only!r}: valid sections are {', '.join(name for name, _, _ in sections)}")
    device = torch.device("cpu" if args.dry_run else "cuda")
    start = time.monotonic()
    report = {"version": 1, "mode": "dry-run" if args.dry_run else "gpu", "date": datetime.datetime.now(
        datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": _commit(), "device": _device_info(device),
        "deadline_s": args.deadline, "tolerances": {"fp32": FP32_TOLERANCE, "bf16": BF16_TOLERANCE,
                                                    "attention": {str(k): v for k, v in ATTENTION_TOLERANCE.items()},
                                                    "parallel_fp32": PARALLEL_TOLERANCE},
        "checks": [], "measurements": [], "skipped_for_deadline": [], "targets": []}
    with tempfile.TemporaryDirectory(prefix="wanmesh-gpu-check-") as work:
        state = Run(device, args.dry_run, dry_run_sizes() if args.dry_run else GPU_SIZES, start + args.deadline,
                    Path(work), report)
        for kind, table in (("checks", CHECKS), ("measurements", MEASUREMENTS)):
            for name, budget, function in table:
                if only is None or name in only:
                    run_section(state, kind, name, budget, function)
    report["targets"] = evaluate_targets(report, args.dry_run)
    report["elapsed_s"] = round(time.monotonic() - start, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_report.json").write_text(json.dumps(report, indent=2, default=str))
    text = markdown(report)
    (args.out / "gpu_report.md").write_text(text)
    print(text)
    print(f"[gpu check] report: {args.out / 'gpu_report.json'}, {args.out / 'gpu_report.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wanmesh bench gpu", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as error:
        print(f"wanmesh bench gpu: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
