"""CollectiveCounter in a one-rank process group (no processes spawned)."""

import datetime

import pytest
import torch
import torch.distributed as dist

from wanmesh.parallel.distributed.collectives import CollectiveCounter


@pytest.fixture
def one_rank_group():
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    yield
    dist.destroy_process_group()


def test_counts_calls_once_and_restores_functions(one_rank_group):
    originals = (dist.isend, dist.all_gather_into_tensor, dist.all_reduce)
    tensor = torch.ones(8)
    with CollectiveCounter() as counter:
        dist.all_reduce(tensor)
        out = torch.empty(8)
        dist.all_gather_into_tensor(out, tensor)  # calls all_gather_single inside: one count
        dist.all_to_all_single(out, tensor)
        with pytest.raises(RuntimeError, match="already active"):
            CollectiveCounter().__enter__()
    assert dict(counter.calls) == {"all_reduce": 1, "all_gather_into_tensor": 1, "all_to_all_single": 1}
    assert counter.total_sent == 0 and counter.total_received == 0  # one rank keeps everything local
    assert (dist.isend, dist.all_gather_into_tensor, dist.all_reduce) == originals
    torch.testing.assert_close(out, tensor)
