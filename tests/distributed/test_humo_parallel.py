"""HuMo's audio attention under the parallel plans: tp 2, Ulysses 2 and ring 2 on spawned gloo
ranks give the one-device prediction of the tiny HuMo network with audio. 3 latent frames of 3 x 3 tokens: 27
tokens, so a rank's slice of 14 starts and ends in the middle of a frame, and the second slice holds a padding
token."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from wanmesh.parallel.config import MESH_DIMS, ParallelConfig, rank_coordinates
from wanmesh.parallel.distributed.context_parallel import apply_context_parallel
from wanmesh.parallel.distributed.mesh import ParallelContext
from wanmesh.parallel.distributed.spawn import spawn_ranks
from wanmesh.parallel.distributed.tensor_parallel import apply_tensor_parallel
from wanmesh.parallel.networks.wan_humo import WanHumoTransformer3DModel
from wanmesh.parallel.tiny.models import TINY_TRANSFORMER, randomise_

TOLERANCE = 5e-5
LAYOUTS = (dict(tp=2), dict(ulysses=2), dict(ring=2))


def _model() -> WanHumoTransformer3DModel:
    model = WanHumoTransformer3DModel(**TINY_TRANSFORMER)
    randomise_(model, 11)
    return model.eval().requires_grad_(False)


def _inputs() -> dict:
    generator = torch.Generator().manual_seed(2)
    return {"hidden_states": torch.randn(1, 16, 3, 6, 6, generator=generator), "timestep": torch.tensor([600.0]),
            "encoder_hidden_states": torch.randn(1, 512, TINY_TRANSFORMER["text_dim"], generator=generator),
            "audio_embed": torch.randn(1, 3, 8, 5, 1280, generator=generator)}


def _rank_main(rank: int, world: int) -> None:
    with torch.no_grad():
        expected = _model()(**_inputs(), return_dict=False)[0]
        plain = _model()(**{**_inputs(), "audio_embed": None}, return_dict=False)[0]
        assert (expected - plain).abs().max() > 100 * TOLERANCE, "the audio changed nothing"
        for layout in LAYOUTS:
            config = ParallelConfig(world=world, **layout)
            mesh = init_device_mesh("cpu", config.mesh_shape, mesh_dim_names=MESH_DIMS)
            plan = ParallelContext(config=config, rank=rank, device=torch.device("cpu"), mesh=mesh,
                                   coords=rank_coordinates(config, rank))
            model = _model()
            apply_tensor_parallel(model, plan.tp_group)
            apply_context_parallel(model, ring_group=plan.ring_group, ulysses_group=plan.ulysses_group)
            got = model(**_inputs(), return_dict=False)[0]
            error = (got - expected).abs().max().item()
            assert error < TOLERANCE, f"{layout}: {error} from one device"


def test_humo_layouts_equal_one_device():
    spawn_ranks(_rank_main, 2, deadline_s=600.0, pg_timeout_s=300.0)
