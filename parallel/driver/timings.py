"""The time breakdown of one run, in the driver (CLI or ComfyUI): the phases the driver waits for (pool start,
text encode, weight load, VAE encode and decode, sampling, writing) and, from the workers' sampling reply, each
rank's per-step compute and communication (``worker/timings.py``); for a stream, each chunk's latency.
``wanmesh generate --timings FILE.json`` and ``wanmesh stream --timings FILE.json`` write it; the WanMesh Sampler
logs its one-line summary after each run."""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path

from ..video_io import written_atomically


class RunTimings:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.ranks: list[dict] = []
        self.chunks: list[dict] = []  # a stream's chunks: index, latent frames, frames, seconds since the last

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def add_sampling(self, rank_timings: list[dict]) -> None:
        self.ranks = list(rank_timings)

    def transfer_s(self) -> float | None:
        """Driver-side sampling time the slowest rank's steps do not account for: moving the request and the
        latents between the driver and the pool (and the workers' set-up of the run)."""
        if "sampling" not in self.phases or not self.ranks:
            return None
        slowest = max(sum(step["wall_s"] for step in rank["steps"]) for rank in self.ranks)
        return max(self.phases["sampling"] - slowest, 0.0)

    def to_dict(self) -> dict:
        chunks = {"chunks": self.chunks} if self.chunks else {}
        return {"phases_s": self.phases, "transfer_s": self.transfer_s(), "ranks": self.ranks, **chunks}

    def summary(self) -> str:
        if self.chunks:
            latencies = [chunk["latency_s"] for chunk in self.chunks]
            return (f"{len(self.chunks)} chunks, first after {latencies[0]:.2f} s, then median "
                    f"{statistics.median(latencies[1:] or latencies):.2f} s per chunk"
                    + "".join(f"; {name} {seconds:.2f} s" for name, seconds in self.phases.items()))
        if not self.ranks or not self.ranks[0]["steps"]:
            return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases.items())
        per_rank = [(statistics.median(s["wall_s"] for s in rank["steps"]),
                     statistics.median(s["communication_s"] for s in rank["steps"])) for rank in self.ranks]
        wall, communication = max(per_rank)
        return (f"{len(self.ranks[0]['steps'])} steps, median {wall:.3f} s/step on the slowest of {len(self.ranks)} "
                f"ranks ({wall - communication:.3f} compute, {communication:.3f} communication)"
                + "".join(f"; {name} {seconds:.2f} s" for name, seconds in self.phases.items()))

    def write(self, path: str | Path) -> None:
        """The breakdown as JSON, written atomically (``video_io.written_atomically``)."""
        with written_atomically(Path(path)) as temporary:
            temporary.write_text(json.dumps(self.to_dict(), indent=2))
