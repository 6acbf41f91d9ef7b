"""The auto layout's cost model and choice (``parallel/auto_layout.py``) and the bench plan's statistics, on made-up
machines whose figures make the right answer known; the calibration's probe on two real gloo ranks."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from wanmesh.parallel.auto_layout import (Job, Layout, Link, Machine, ModelCost, block_bytes, candidate_layouts,
                                          choose, explain, predict)
from wanmesh.parallel.bench.plan import measured_subset, spearman
from wanmesh.parallel.config import ParallelConfig
from wanmesh.parallel.distributed.tensor_parallel import analytic_collectives

WAN_14B = ModelCost(layers=40, heads=40, head_dim=128, ffn_dim=13824, weight_bytes=28 * 2**30)
SMALL = ModelCost(layers=8, heads=16, head_dim=64, ffn_dim=4096, weight_bytes=280 * 2**20)
JOB = Job(832, 480, 81, steps=30)


def machine(*, link_bytes_per_s: float = 1e9, latency_s: float = 1e-4, free_gib: float = 80.0,
            overlap: float = 0.0) -> Machine:
    link = Link(latency_s, link_bytes_per_s)
    return Machine(matmul_flops=1e11, attention_flops=1e11, all_reduce=link, all_to_all=link, send_recv=link,
                   free_bytes=int(free_gib * 2**30), overlap=overlap)


def test_candidates_split_the_heads_and_respect_guidance_and_streaming():
    layouts = candidate_layouts(4, SMALL, JOB)
    assert Layout(tp=2, ulysses=2, vae_patch=4) in layouts and Layout(ring=2, cfg_parallel=True, vae_patch=4) in layouts
    assert all(SMALL.heads % (layout.tp * layout.ulysses) == 0 for layout in layouts)
    assert len(set(layouts)) == len(layouts)
    no_guidance = candidate_layouts(4, SMALL, Job(832, 480, 81, guidance=False))
    assert not any(layout.cfg_parallel for layout in no_guidance)
    streaming = candidate_layouts(4, SMALL, JOB, streaming=True)
    assert all(layout.ring == 1 and not layout.cfg_parallel and layout.vae_patch == 1 for layout in streaming)
    assert all(layout.tp != 3 for layout in candidate_layouts(6, ModelCost(4, 4, 32, 256, 1), JOB))


def test_a_latent_gives_the_job_of_its_video():
    wan21 = Job.of_latent((2, 16, 21, 60, 104), steps=4, batch=1, guidance=True)
    assert (wan21.width, wan21.height, wan21.frames, wan21.steps, wan21.batch) == (832, 480, 81, 4, 1)
    wan22 = Job.of_latent((1, 48, 31, 44, 80), steps=4, batch=1, guidance=False)  # the TI2V 5B's 16x VAE
    assert (wan22.width, wan22.height, wan22.frames, wan22.guidance) == (1280, 704, 121, False)
    image_to_video = Job.of_latent((1, 36, 21, 60, 104), steps=4, batch=1, guidance=True)  # mask and image channels
    assert (image_to_video.width, image_to_video.height) == (832, 480)


def test_tensor_parallel_bytes_are_the_analytic_count():
    for tp in (2, 4):
        local, text, dim = 1560, 512, 5120
        analytic = analytic_collectives(num_blocks=1, batch=1, video_tokens=local, text_tokens=text, dim=dim, tp=tp,
                                        activation_bytes=2)
        assert block_bytes(Layout(tp=tp), local, text, dim, 2)["all_reduce"] == pytest.approx(analytic["sent_bytes"],
                                                                                                rel=1e-3)


def test_slow_links_favour_cfg_parallel_fast_links_favour_splitting_the_sequence():
    slow = choose(2, SMALL, JOB, machine(link_bytes_per_s=1e7))[0].layout
    assert slow.cfg_parallel and slow.tp == 1
    fast = choose(2, SMALL, Job(832, 480, 81, guidance=False), machine(link_bytes_per_s=1e12))
    data_parallel = next(p for p in fast if p.layout.tp * p.layout.ulysses * p.layout.ring == 1)
    assert fast[0].step_s == pytest.approx(data_parallel.step_s / 2, rel=0.05), explain(fast, JOB)


def test_weights_that_do_not_fit_one_rank_force_tensor_parallelism():
    ranked = choose(4, WAN_14B, JOB, machine(free_gib=20.0))
    assert ranked[0].fits and ranked[0].layout.tp >= 2
    assert all(p.fits for p in ranked[:1]) and not predict(Layout(), 4, WAN_14B, JOB, machine(free_gib=20.0)).fits


def test_nothing_fits_is_one_line_naming_the_bytes():
    with pytest.raises(ValueError) as error:
        choose(2, WAN_14B, JOB, machine(free_gib=4.0))
    message = str(error.value)
    assert "\n" not in message and "GiB per rank" in message and "4.00 GiB are free" in message


def test_predicted_step_time_falls_with_ranks_when_links_are_free():
    one = predict(Layout(), 1, SMALL, JOB, machine(link_bytes_per_s=1e15, latency_s=0)).step_s
    two = predict(Layout(ulysses=2), 2, SMALL, JOB, machine(link_bytes_per_s=1e15, latency_s=0)).step_s
    assert two == pytest.approx(one / 2, rel=0.05)


def test_ring_traffic_hides_behind_attention_as_far_as_the_device_overlaps():
    hidden = predict(Layout(ring=2), 2, SMALL, JOB, machine(overlap=1.0)).communication_s
    exposed = predict(Layout(ring=2), 2, SMALL, JOB, machine(overlap=0.0)).communication_s
    assert hidden < exposed


def test_collectives_are_priced_at_their_group_size():
    slow, fast = Link(1e-2, 1e6), Link(0.0, 1e15)
    by_group = replace(machine(), group_links=((2, "all_reduce", slow), (4, "all_reduce", fast)))
    all_slow = replace(machine(), all_reduce=slow)
    all_fast = replace(machine(), all_reduce=fast)
    # tp 2 beside CFG parallel in 4 ranks: its all-reduces (and the guidance exchange) run within pairs
    tp2 = Layout(tp=2, cfg_parallel=True)
    assert predict(tp2, 4, SMALL, JOB, by_group).step_s == predict(tp2, 4, SMALL, JOB, all_slow).step_s
    assert predict(Layout(tp=4), 4, SMALL, JOB, by_group).step_s == predict(Layout(tp=4), 4, SMALL, JOB,
                                                                            all_fast).step_s
    assert by_group.link("all_to_all", 2) == by_group.all_to_all  # a kind without a group figure: the world's


def test_one_group_alone_is_priced_as_measured_alone():
    at_once, alone = Link(4e-3, 1e9), Link(2e-4, 1e9)
    pairs = replace(machine(), send_recv=Link(5e-4, 1e9), group_links=((2, "send_recv", at_once),),
                    group_links_alone=((2, "send_recv", alone),))
    # ring 2 beside data parallel with a batch of one: one pair exchanges while the other waits
    one_pair = predict(Layout(ring=2), 4, SMALL, JOB, pairs).communication_s
    assert one_pair == predict(Layout(ring=2), 4, SMALL, JOB, replace(pairs, send_recv=alone,
                                                                       group_links=())).communication_s
    # with CFG parallel both pairs exchange at once
    both = predict(Layout(ring=2, cfg_parallel=True), 4, SMALL, JOB, pairs)
    assert both.communication_s == predict(Layout(ring=2, cfg_parallel=True), 4, SMALL, JOB,
                                           replace(pairs, group_links_alone=())).communication_s
    assert pairs.link("send_recv", 4, alone=True) == pairs.send_recv  # no figure alone for that size: at once


def test_collectives_between_busy_ranks_cost_at_least_the_busy_latency():
    waits = replace(machine(latency_s=1e-4), busy_latency_s=0.05)
    assert waits.link("all_to_all", 2, every_rank_busy=True).latency_s == 0.05
    assert waits.link("all_to_all", 2).latency_s == 1e-4
    # ulysses 2 beside CFG parallel keeps all 4 ranks busy: its 2 all-to-alls per block and the guidance exchange
    busy = predict(Layout(ulysses=2, cfg_parallel=True), 4, SMALL, JOB, waits).communication_s
    idle = predict(Layout(ulysses=2, cfg_parallel=True), 4, SMALL, JOB, machine(latency_s=1e-4)).communication_s
    assert busy - idle == pytest.approx((2 * SMALL.layers + 1) * (0.05 - 1e-4), rel=1e-6)
    # pairs inside 4 ranks wait for one partner: their own busy latency when measured, else the whole world's
    by_size = replace(waits, busy_latencies=((2, 0.02), (4, 0.05)))
    assert [by_size.link("all_reduce", size, every_rank_busy=True).latency_s for size in (2, 4)] == [0.02, 0.05]
    pairs = predict(Layout(ulysses=2, cfg_parallel=True), 4, SMALL, JOB, by_size).communication_s
    assert pairs - idle == pytest.approx((2 * SMALL.layers + 1) * (0.02 - 1e-4), rel=1e-6)
    # ulysses 2 beside data parallel with a batch of one: the other pair waits, so no call waits for a core
    half = Layout(ulysses=2)
    assert predict(half, 4, SMALL, JOB, waits).step_s == predict(half, 4, SMALL, JOB, machine(latency_s=1e-4)).step_s


def test_ranks_that_share_cores_compute_as_fast_as_measured_with_that_many_busy():
    measured = replace(machine(), matmul_flops_by_active=((1, 3e11), (2, 2e11), (4, 1e11)))
    assert [measured.speed_up(4, active) for active in (1, 2, 4)] == [3.0, 2.0, 1.0]
    assert replace(machine(), matmul_flops_alone=3e11).speed_up(4, 2) == 2.0  # without the table: the idle share
    # CFG parallel beside data parallel keeps 2 of 4 ranks busy with a batch of one
    two_busy = predict(Layout(cfg_parallel=True), 4, SMALL, JOB, measured)
    as_if_faster = predict(Layout(cfg_parallel=True), 4, SMALL, JOB,
                           replace(machine(), matmul_flops=2e11, attention_flops=2e11))
    assert two_busy.compute_s == pytest.approx(as_if_faster.compute_s, rel=1e-9)


def test_idle_ranks_give_no_more_speed_than_the_cores_allow():
    # two one-thread ranks on two cores never share one: a lone rank measured faster measured noise
    two = replace(machine(), matmul_flops=1e11, matmul_flops_by_active=((1, 1.8e11), (2, 1e11)), cpu_cores=2)
    assert two.speed_up(2, 1) == 1.0
    data_parallel = predict(Layout(), 2, SMALL, JOB, two)  # with a batch of one the second rank waits
    cfg_parallel = predict(Layout(cfg_parallel=True), 2, SMALL, JOB, two)
    assert data_parallel.compute_s == pytest.approx(2 * cfg_parallel.compute_s, rel=1e-9)
    # four on two cores share them in pairs: half of them busy get at most twice as much each
    four = replace(machine(), matmul_flops_by_active=((1, 3e11), (2, 2.5e11), (4, 1e11)), cpu_cores=2)
    assert [four.speed_up(4, active) for active in (1, 2, 4)] == [2.0, 2.0, 1.0]
    eight = replace(four, matmul_flops_by_active=((2, 2.5e11), (8, 1e11)))
    assert eight.speed_up(8, 2) == 4.0  # eight on two cores get a quarter of one each: two busy get a whole one


def test_a_slower_reading_than_a_busier_one_implies_counts_as_the_busier_one_implies():
    # as read on two cores: four busy ranks did more work in all than two could (2 x 78 against 4 x 41 GFLOP/s),
    # and one busy rank read slower than two
    cores = replace(machine(), matmul_flops=41e9, matmul_flops_by_active=((1, 67e9), (2, 78e9), (4, 41e9)),
                    cpu_cores=2)
    assert cores.speeds_by_active() == {1: 82e9, 2: 82e9, 4: 41e9}
    assert cores.speed_up(4, 2) == 2.0  # not the 1.9 the readings give
    ring_cfg, cfg = (predict(layout, 4, SMALL, JOB, cores) for layout in (Layout(ring=2, cfg_parallel=True),
                                                                          Layout(cfg_parallel=True)))
    # half the work at half the speed takes as long (the text projections aside): the readings made it 5% faster
    assert ring_cfg.compute_s == pytest.approx(cfg.compute_s, rel=0.005)
    # ranks with devices of their own: only fewer busy ranks never read slower
    devices = replace(cores, cpu_cores=0, matmul_flops_by_active=((1, 90e9), (2, 100e9), (4, 60e9)))
    assert devices.speeds_by_active() == {1: 100e9, 2: 100e9, 4: 60e9}


def test_spearman_and_the_measured_subset():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    ranked = choose(8, SMALL, JOB, machine())
    subset = measured_subset(ranked, 6)
    assert len(subset) == 6 and subset[:4] == ranked[:4] and ranked[-1] in subset
    assert measured_subset(ranked[:3], 6) == ranked[:3]


def test_each_speed_is_the_fastest_of_interleaved_rounds():
    """A slow spell on a shared machine slows one round's reading; the fastest round counts, and each round
    measures every setting, so the spell cannot fall on one setting only."""
    from wanmesh.parallel import calibration

    calls, matmul, attention = [], iter([3.0, 1.0, 2.0]), iter([5.0, 6.0, 4.0])
    by_active, attention_s = calibration._fastest_of_rounds(
        lambda: calls.append("matmul") or next(matmul), lambda: calls.append("attention") or next(attention),
        world=1, barrier=lambda: None)
    assert (by_active, attention_s) == ({1: 1.0}, 4.0)
    assert calls == ["matmul", "attention"] * calibration.SPEED_ROUNDS


def test_the_probe_measures_two_gloo_ranks_and_caches_its_figures(tmp_path, monkeypatch):
    from wanmesh.parallel import calibration

    monkeypatch.setenv("WANMESH_CACHE", str(tmp_path))
    config = ParallelConfig(world=2, devices="cpu")
    measured = calibration.machine_for(config)
    cached = json.loads(calibration.cache_file(config).read_text())
    assert cached["world"] == 2 and cached["probe_s"] < 20
    assert measured.matmul_flops > 0 and measured.all_reduce.bytes_per_s > 0 and measured.free_bytes > 0
    assert 0 < measured.all_reduce.latency_s < 1
    assert set(cached["matmul_flops_by_active"]) == {"1", "2"} and set(cached["group_links"]) == {"2"}
    assert measured.link("send_recv", 2) == measured.send_recv  # two ranks: the one group is the world
    assert 0 <= measured.busy_latency_s < 1 and cached["version"] == calibration.PROBE_VERSION
    assert measured.busy_latencies == ((2, measured.busy_latency_s),)  # two ranks: the one group is the world
    assert (measured.cpu_cores, measured.rank_threads) == (os.cpu_count(), max(1, os.cpu_count() // 2))
    assert calibration.machine_for(config) == measured  # read back from the cache, not probed again


def test_the_probe_of_four_ranks_prices_pairs_and_the_whole_world(tmp_path, monkeypatch):
    from wanmesh.parallel import calibration

    monkeypatch.setenv("WANMESH_CACHE", str(tmp_path))
    measured = calibration.machine_for(ParallelConfig(world=4, devices="cpu"))
    assert [size for size, _ in measured.busy_latencies] == [2, 4]
    assert dict(measured.busy_latencies)[4] == measured.busy_latency_s
    assert {(size, kind) for size, kind, _ in measured.group_links} == {
        (size, kind) for size in (2, 4) for kind in ("all_reduce", "all_to_all", "send_recv")}
    assert {(size, kind) for size, kind, _ in measured.group_links_alone} == {
        (2, kind) for kind in ("all_reduce", "all_to_all", "send_recv")}  # the whole world is never alone
    assert [active for active, _ in measured.matmul_flops_by_active] == [1, 2, 4]


@pytest.mark.parametrize("kind, context_tokens, latent_channels, tokens", [
    ("model", 512, 16, 1280),  # T2V: 17 frames at 256x256 through the 8x VAE and 2x2 patches: 5 x 16 x 16
    ("i2v", 512 + 257, 16, 1280),  # Wan 2.1 I2V: the cross-attention also reads one image's CLIP vision tokens
    ("flf2v", 512 + 2 * 257, 16, 1280),  # FLF2V: two images' tokens
    ("i2v_high", 512, 16, 1280),  # Wan 2.2 I2V A14B: image latents only
    ("ti2v", 512, 48, 320),  # Wan 2.2 TI2V 5B: 48 channels through the 16x VAE, a quarter of the tokens
])
def test_the_cost_model_reads_image_tokens_and_the_vae_from_the_file(tiny_models_root, kind, context_tokens,
                                                                    latent_channels, tokens):
    from wanmesh.parallel.tiny.files import TINY_FILES

    model = ModelCost.from_file(tiny_models_root / TINY_FILES[kind])
    job = Job(256, 256, 17)
    assert (model.text_tokens, model.latent_channels, job.video_tokens(model)) == (context_tokens, latent_channels,
                                                                                   tokens)
    assert job.latent_elements(model) == latent_channels * 5 * (256 // model.vae_factor) ** 2
    cfg = predict(Layout(cfg_parallel=True), 2, model, job, machine(link_bytes_per_s=1e6, latency_s=0.0))
    plain = predict(Layout(cfg_parallel=True), 2, model, job, machine(link_bytes_per_s=1e15, latency_s=0.0))
    assert cfg.step_s - plain.step_s == pytest.approx(4 * job.latent_elements(model) / 1e6, rel=1e-6)
