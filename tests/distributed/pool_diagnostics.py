"""Diagnostic ops the pool tests inject into their workers (``WorkerPool(diagnostics=<this file>)``).

Each op runs on every rank with ``(ctx, args, tensors)`` and rank 0's result is the reply. They stand in for
engine work: step loops with progress and a collective per step, and faults on one chosen rank.
"""

import time

import torch
import torch.distributed as dist

from wanmesh.parallel.protocol import DiagnosticResult


class Stopped(RuntimeError):
    pass


def scaled_gather(ctx, args, tensors):
    """Each rank maps its chunk of x to 2x+1; rank 0 gathers the pieces: the result is independent of world."""
    (x,) = tensors
    world = dist.get_world_size()
    pieces = list(x.chunk(world))
    mine = pieces[ctx.rank] * 2 + 1
    gathered = [torch.empty_like(p) for p in pieces]
    dist.all_gather(gathered, mine.contiguous())
    return DiagnosticResult(tensors=[torch.cat(gathered)], info={"world": world})


def steps(ctx, args, tensors):
    """A stand-in sampling loop: stop check, a collective and a progress report per step."""
    total = int(args.get("steps", 10))
    for step in range(total):
        if ctx.should_stop():
            raise Stopped(f"stopped before step {step + 1}")
        time.sleep(float(args.get("step_s", 0.05)))
        flag = torch.ones(1)
        dist.all_reduce(flag)
        ctx.progress(step + 1, total)
    return DiagnosticResult(info={"steps": total})


def fail(ctx, args, tensors):
    """Raise on the ranks in args['ranks']; the other ranks wait in a barrier (as they would in a collective)."""
    if ctx.rank in args["ranks"]:
        raise ValueError(f"injected failure on rank {ctx.rank}")
    dist.barrier()
    return DiagnosticResult()


def hang(ctx, args, tensors):
    """Rank args['rank'] sleeps far past any timeout; the others return."""
    if ctx.rank == args["rank"]:
        time.sleep(3600)
    return DiagnosticResult()


def collector(ctx, args, tensors):
    """What this rank's garbage collector walks: the objects frozen out of its sight, and the objects it tracks."""
    import gc

    return DiagnosticResult(info={"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())})


DIAGNOSTICS = {"scaled_gather": scaled_gather, "steps": steps, "fail": fail, "hang": hang, "collector": collector}
