"""A diagnostic op the two-expert pool test injects into its workers (``WorkerPool(diagnostics=<this file>)``).

``resident_memory`` gathers, from every rank, the parameter bytes and the object id of each resident model
(the ids show that a sample did not reload anything) and the process's resident set size.
"""

import torch.distributed as dist

from wanmesh.parallel.protocol import DiagnosticResult


def _rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def resident_memory(ctx, args, tensors):
    models = ctx.executor._models
    mine = {
        "rank": ctx.rank,
        "rss": _rss_bytes(),
        "models": {handle: {"id": id(model), "parameter_bytes": sum(p.numel() * p.element_size()
                                                                     for p in model.parameters())}
                   for handle, model in models.items() if handle.startswith("model|")},
    }
    ranks = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(ranks, mine)
    return DiagnosticResult(info={"ranks": ranks})


DIAGNOSTICS = {"resident_memory": resident_memory}
