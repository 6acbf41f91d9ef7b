"""`wanmesh bench cli-start`: how long the command line takes to answer `--help` and to refuse bad flags and
values, each in a fresh interpreter as a user runs it (median and spread over ``--runs``); and whether parsing
imported torch. Runs in the CLI process; the measured commands are subprocesses. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ..cli.progress import Progress

# (case, arguments, exit status expected): the help texts and refusals the parser and the quick checks give
CASES = [
    ("--help", ["--help"], 0),
    ("generate --help", ["generate", "--help"], 0),
    ("bad flag", ["generate", "--prompt", "x", "--out", "x.mp4", "--no-such-flag"], 2),
    ("bad choice", ["generate", "--prompt", "x", "--out", "x.mp4", "--sampler", "foo"], 2),
    ("bad width", ["generate", "--prompt", "x", "--out", "x.mp4", "--width", "100"], 2),
    ("bad layout", ["generate", "--prompt", "x", "--out", "x.mp4", "--world", "3", "--tp", "2"], 2),
    ("bad fps", ["stream", "--prompt", "x", "--out", "x.mp4", "--chunk-dir", "c", "--fps", "0"], 2),
]
PARSER_IMPORTS = ("import sys, wanmesh.parallel.cli as cli; cli.build_parser(False); "
                  "print(','.join(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=5, help="fresh interpreters per case (default 5)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--quiet", "-q", action="store_true", help="no line per measured run")


def run(args) -> list[dict]:
    if args.runs < 1:
        raise ValueError(f"--runs must be at least 1, got {args.runs}")
    progress = Progress(args.quiet)
    tick = progress.steps("measured runs", unit="run")
    total, done, rows = len(CASES) * args.runs, 0, []
    for name, arguments, expected in CASES:
        seconds = []
        for _ in range(args.runs):
            seconds.append(_time_command(arguments, expected))
            done += 1
            tick(done, total)
        rows.append({"case": name, "median_s": statistics.median(seconds), "min_s": min(seconds),
                     "max_s": max(seconds), "runs": args.runs})
    heavy = subprocess.run([sys.executable, "-c", PARSER_IMPORTS], capture_output=True, text=True, check=True)
    print(f"{'case':18s} {'median s':>9s} {'min s':>7s} {'max s':>7s}")
    for row in rows:
        print(f"{row['case']:18s} {row['median_s']:9.3f} {row['min_s']:7.3f} {row['max_s']:7.3f}")
    print(f"heavy modules imported by parsing: {heavy.stdout.strip() or 'none'}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "parser_imports": heavy.stdout.strip()}, indent=2))
    return rows


def _time_command(arguments: list[str], expected: int) -> float:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", f"{__package__.rpartition('.')[0]}.cli", *arguments],
                            capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - started
    if result.returncode != expected:
        raise RuntimeError(f"`wanmesh {' '.join(arguments)}` exited {result.returncode}, expected {expected}: "
                           f"{result.stderr.strip()[-300:]}")
    return seconds
