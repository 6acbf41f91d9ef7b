"""The per-rank time breakdown of one sampling run (``SampleRequest.timings``); runs in the workers.

Every rank times each denoising step (wall time from the previous step's end) and the part of it spent inside
torch.distributed calls (``CollectiveCounter``, CUDA work waited for around each call so asynchronous NCCL calls
count whole); compute is the rest. Rank 0 replies with every rank's figures, gathered over the pool's group.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..distributed.collectives import CollectiveCounter


class StepClock:
    """The sampler's progress callback, passed through, noting when each step ends and the collective seconds and
    bytes so far; the preview hook (``attach_preview``) still reaches the wrapped callback."""

    def __init__(self, progress, counter: CollectiveCounter):
        self._progress, self._counter = progress, counter
        self._marks = [(time.perf_counter(), 0.0, 0)]

    def __call__(self, step: int, total: int) -> None:
        self._marks.append((time.perf_counter(), self._counter.total_seconds, self._counter.total_sent))
        if self._progress is not None:
            self._progress(step, total)

    def __getattr__(self, name: str):
        return getattr(self._progress, name)

    def steps(self) -> list[dict]:
        rows = []
        for (start, comm_before, sent_before), (end, comm_after, sent_after) in zip(self._marks, self._marks[1:]):
            communication = comm_after - comm_before
            rows.append({"wall_s": end - start, "communication_s": communication,
                         "compute_s": max(end - start - communication, 0.0), "sent_bytes": sent_after - sent_before})
        return rows


def timed(sample, progress, device: torch.device, rank: int, distributed: bool):
    """``sample(progress)``'s result and every rank's step breakdown (rank 0 gets them all, others their own)."""
    with CollectiveCounter(synchronize=device) as counter:
        clock = StepClock(progress, counter)
        result = sample(clock)
    own = {"rank": rank, "steps": clock.steps()}
    if not distributed:
        return result, [own]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, own)
    return result, gathered
