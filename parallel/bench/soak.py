"""`wanmesh bench soak`: many prompts against a running ComfyUI server, and whether its memory stays flat; runs in
the CLI process and talks to the server over HTTP only.

It queues ``--prompts`` API workflows in turn (by default the mixed set of ``workflows/api/``: text-to-video,
text-to-video with a LoRA whose strength changes every time, a VACE inpaint and image-to-video), each with a
fresh seed, one at a time (``POST /prompt``, then ``/history`` until it is done). After ``--warm-up`` prompts
(allocators and caches settle) it takes the baseline, then the final figures after the last prompt:

* the server's and each worker's resident memory (RSS; the workers are the server's descendants whose command
  line has ``--rank``), their growth in percent;
* the open file descriptors of the server and of the workers;
* the server's shared-memory segments in ``/dev/shm`` (names ``wanmesh_<server pid>_...``; count and bytes).

The server must run on this machine (its process is found by the port it listens on, or ``--server-pid``).
A table is printed and ``--json`` writes the same figures. Nothing here judges the numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows" / "api"
DEFAULT_MIX = ("t2v", "t2v_lora", "vace_inpaint", "i2v")
SHM = Path("/dev/shm")
SEGMENT_PREFIX = "wanmesh_"
MIB = 2**20
PROMPT_TIMEOUT_S = 1800.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", required=True, help="ComfyUI's address, e.g. http://127.0.0.1:8188")
    parser.add_argument("--prompts", type=int, default=100, help="prompts to run; default %(default)s")
    parser.add_argument("--warm-up", type=int, default=None,
                        help="prompts before the baseline is taken; default a tenth of --prompts (at least 1)")
    parser.add_argument("--workflow", action="append", default=None,
                        help="an API workflow file to run (repeat for a mix); default: the workflows/api/ files "
                             f"{', '.join(DEFAULT_MIX)}")
    parser.add_argument("--server-pid", type=int, default=None, help="the server's process id (default: the "
                        "process listening on the --server port)")
    parser.add_argument("--each-pool", action="store_true", help="keep each workflow's own Pool settings (a "
                        "changed setting restarts the pool); default: every prompt gets the first workflow's")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here as JSON")


def check_arguments(args) -> int:
    if args.prompts < 2:
        raise ValueError(f"--prompts {args.prompts} is too few; valid: 2 or more (a warm-up and a measured prompt)")
    warm_up = max(1, args.prompts // 10) if args.warm_up is None else args.warm_up
    if not 1 <= warm_up < args.prompts:
        raise ValueError(f"--warm-up {warm_up} is not valid; valid: 1 to {args.prompts - 1} (below --prompts)")
    if urllib.parse.urlparse(args.server).scheme not in ("http", "https"):
        raise ValueError(f"--server {args.server} is not an http(s) address; e.g. http://127.0.0.1:8188")
    return warm_up


# -- the server ----------------------------------------------------------------------------------------------


class Server:
    """ComfyUI's HTTP API, as far as a soak needs it."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.client_id = uuid.uuid4().hex

    def _json(self, path: str, body: dict | None = None, timeout_s: float = 30.0):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())

    def run(self, prompt: dict) -> float:
        """Queue ``prompt`` and wait until it is done; its seconds. A refused or failed prompt raises."""
        started = time.monotonic()
        try:
            prompt_id = self._json("/prompt", {"prompt": prompt, "client_id": self.client_id})["prompt_id"]
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"the server refused a prompt: {error.read().decode()[:300]}") from None
        while time.monotonic() - started < PROMPT_TIMEOUT_S:
            entry = self._json(f"/history/{prompt_id}").get(prompt_id)
            status = (entry or {}).get("status", {})
            if status.get("completed") or status.get("status_str") == "error":
                if status.get("status_str") != "success":
                    errors = [data for event, data in status.get("messages", []) if event == "execution_error"]
                    message = errors[0].get("exception_message", "") if errors else status.get("status_str")
                    raise RuntimeError(f"a prompt failed on the server: {str(message).strip()[:300]}")
                return time.monotonic() - started
            time.sleep(0.1)
        raise RuntimeError(f"a prompt did not finish within {PROMPT_TIMEOUT_S:g} s")


def server_process(url: str, pid: int | None):
    """The server's process: ``pid``, or the one listening on the URL's port."""
    import psutil

    if pid is not None:
        return psutil.Process(pid)
    port = urllib.parse.urlparse(url).port or 80
    for connection in psutil.net_connections(kind="tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port and connection.pid:
            return psutil.Process(connection.pid)
    raise ValueError(f"no process on this machine listens on port {port}; give --server-pid")


def worker_rank(proc) -> int | None:
    """The rank a psutil process serves, from the ``--rank N`` its command line ends with (None for any other
    process, or one that ended meanwhile)."""
    import psutil

    try:
        # " ".join, then split: a worker forked by the worker template shows a retitled command line, which
        # psutil reads as one string
        words = " ".join(proc.cmdline()).split()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None
    return int(words[-1]) if len(words) >= 2 and words[-2] == "--rank" else None


def worker_processes(processes) -> list:
    """The WanMesh workers among ``processes`` (psutil processes, e.g. a server's descendants), in rank order;
    processes that ended meanwhile are left out."""
    ranked = [(worker_rank(proc), proc) for proc in processes]
    return [proc for rank, proc in sorted(((r, p) for r, p in ranked if r is not None), key=lambda rp: rp[0])]


def sample(server) -> dict:
    """RSS (bytes), file descriptors and shared-memory segments now."""
    workers = worker_processes(server.children(recursive=True))
    prefix = f"{SEGMENT_PREFIX}{server.pid}_"  # the server's pool's segments (named by the driver's process id)
    segments = [entry for entry in SHM.iterdir() if entry.name.startswith(prefix)] if SHM.is_dir() else []
    return {
        "server_rss": server.memory_info().rss,
        "worker_rss": [proc.memory_info().rss for proc in workers],
        "server_fds": server.num_fds(),
        "worker_fds": sum(proc.num_fds() for proc in workers),
        "workers": len(workers),
        "shm_segments": len(segments),
        "shm_bytes": sum(entry.stat().st_size for entry in segments if entry.exists()),
    }


# -- the prompts ---------------------------------------------------------------------------------------------


def load_mix(files: list[str] | None) -> list[tuple[str, dict]]:
    paths = [Path(f) for f in files] if files else [WORKFLOWS / f"{name}.json" for name in DEFAULT_MIX]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise ValueError(f"--workflow {missing[0]} does not exist; give an API workflow file (Export (API))")
    return [(path.stem, json.loads(path.read_text())) for path in paths]


def prepared(prompt: dict, index: int, rng: random.Random, pool: dict | None = None) -> dict:
    """A fresh seed for every sampler; a LoRA strength that changes from run to run (a LoRA change each time);
    the Pool node's settings replaced by ``pool`` when given (one pool for the whole soak)."""
    prompt = json.loads(json.dumps(prompt))
    for node in prompt.values():
        inputs = node.get("inputs", {})
        if pool is not None and node.get("class_type") == "WanMeshPool":
            inputs.update(pool)
        for key in ("seed", "noise_seed"):
            if isinstance(inputs.get(key), int):
                inputs[key] = rng.randrange(2**32)
        if "Lora" in node.get("class_type", "") and isinstance(inputs.get("strength"), (int, float)):
            inputs["strength"] = (0.5, 1.0)[index % 2]
    return prompt


def pool_settings(prompt: dict) -> dict | None:
    """The widget values of a workflow's Pool node (None without one)."""
    for node in prompt.values():
        if node.get("class_type") == "WanMeshPool":
            return {key: value for key, value in node["inputs"].items() if not isinstance(value, list)}
    return None


def growth(before: float, after: float) -> float:
    return 100.0 * (after / before - 1.0) if before else 0.0


def report(baseline: dict, final: dict, prompts: int, warm_up: int, seconds: list[float]) -> dict:
    rows = {
        "server RSS (MiB)": (baseline["server_rss"] / MIB, final["server_rss"] / MIB),
        "workers RSS, sum (MiB)": (sum(baseline["worker_rss"]) / MIB, sum(final["worker_rss"]) / MIB),
        "largest worker RSS (MiB)": (max(baseline["worker_rss"], default=0) / MIB, max(final["worker_rss"], default=0) / MIB),
        "server fds": (baseline["server_fds"], final["server_fds"]),
        "worker fds, sum": (baseline["worker_fds"], final["worker_fds"]),
        "workers": (baseline["workers"], final["workers"]),
        "/dev/shm segments": (baseline["shm_segments"], final["shm_segments"]),
        "/dev/shm bytes": (baseline["shm_bytes"], final["shm_bytes"]),
    }
    return {"prompts": prompts, "warm_up": warm_up, "median_prompt_s": sorted(seconds)[len(seconds) // 2],
            "baseline": baseline, "final": final,
            "rows": {name: {"after_warm_up": before, "final": after, "growth_percent": growth(before, after)}
                     for name, (before, after) in rows.items()}}


def table(result: dict) -> str:
    lines = [f"soak: {result['prompts']} prompts, baseline after {result['warm_up']}, median "
             f"{result['median_prompt_s']:.2f} s per prompt",
             f"| {'figure':<28} | {'after warm-up':>13} | {'final':>10} | {'growth':>8} |",
             f"|{'-' * 30}|{'-' * 15}|{'-' * 12}|{'-' * 10}|"]
    for name, row in result["rows"].items():
        lines.append(f"| {name:<28} | {row['after_warm_up']:>13.1f} | {row['final']:>10.1f} | "
                     f"{row['growth_percent']:>+7.2f}% |")
    return "\n".join(lines)


def run(args) -> int:
    warm_up = check_arguments(args)
    mix = load_mix(args.workflow)
    server = Server(args.server)
    process = server_process(args.server, args.server_pid)
    rng = random.Random(0)
    pool = None if args.each_pool else pool_settings(mix[0][1])
    seconds, baseline = [], None
    for index in range(args.prompts):
        name, prompt = mix[index % len(mix)]
        seconds.append(server.run(prepared(prompt, index // len(mix), rng, pool)))
        print(f"\r  prompt {index + 1}/{args.prompts} ({name}) {seconds[-1]:.2f} s", end="", flush=True)
        if index + 1 == warm_up:
            baseline = sample(process)
    print()
    result = report(baseline, sample(process), args.prompts, warm_up, seconds[warm_up:])
    print(table(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0
