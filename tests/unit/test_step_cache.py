"""Step-cache settings: the --cache text, one-line refusals of bad input, the published tables and the model
variants they belong to."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from wanmesh.parallel.protocol import ModelForward, SampleRequest
from wanmesh.parallel.sampling.cache_tables import MAGCACHE_RATIOS, TEACACHE_POLYNOMIALS, wan_variant
from wanmesh.parallel.cache_settings import CacheSettings, cache_fields, parse_cache
from wanmesh.parallel.sampling.step_cache import _nearest


def test_cache_text_gives_settings():
    assert parse_cache("teacache:0.25") == CacheSettings("teacache", 0.25)
    assert parse_cache("magcache:0.1:k=3:start=0.3") == CacheSettings("magcache", 0.1, 0.3, max_skips=3)
    assert parse_cache("fbcache:end=0.9:coefficients=generic") == CacheSettings("fbcache", 0.08, end_percent=0.9,
                                                                                  coefficients="generic")
    assert parse_cache("") is None


@pytest.mark.parametrize("text,named", [("easycache:0.2", "easycache"), ("teacache:-0.1", "-0.1"),
                                        ("teacache:0.2:start=0.8:end=0.5", "start_percent 0.8"),
                                        ("magcache:0.1:k=-1", "max_skips -1"), ("fbcache:x", "'x'")])
def test_bad_cache_input_is_one_line_naming_the_value(text, named):
    with pytest.raises(ValueError) as error:
        parse_cache(text)
    assert named in str(error.value) and "\n" not in str(error.value) and len(str(error.value)) <= 300


def test_requests_refuse_bad_settings_before_work():
    import torch

    request = ModelForward("m", torch.zeros(1, 16, 1, 2, 2), torch.ones(1), torch.zeros(1, 4, 8),
                           cache={"method": "teacache", "threshold": 0.2, "start_percent": 0.9, "end_percent": 0.1})
    with pytest.raises(ValueError, match="start_percent 0.9 is after end_percent 0.1"):
        request.validate()
    assert SampleRequest.__dataclass_fields__["cache"].default is None
    assert cache_fields(CacheSettings("magcache", 0.1))["method"] == "magcache"


def _config(dim, layers, in_channels, out_channels=16, image_dim=None):
    return SimpleNamespace(num_attention_heads=dim // 128, attention_head_dim=128, num_layers=layers,
                           in_channels=in_channels, out_channels=out_channels, image_dim=image_dim)


def test_released_shapes_find_their_published_numbers():
    assert wan_variant(_config(1536, 30, 16), 1560) == "wan2.1_t2v_1.3b"
    assert wan_variant(_config(5120, 40, 16), 1560) == "wan2.1_t2v_14b"
    assert wan_variant(_config(5120, 40, 36, image_dim=1280), 1560) == "wan2.1_i2v_14b_480p"
    assert wan_variant(_config(5120, 40, 36, image_dim=1280), 3600) == "wan2.1_i2v_14b_720p"
    assert wan_variant(_config(3072, 30, 48, 48), 1560) == "wan2.2_ti2v_5b"
    assert wan_variant(_config(5120, 40, 16), 1560, experts=2) == "wan2.2_t2v_a14b"
    assert wan_variant(_config(5120, 40, 36), 1560) == "wan2.2_i2v_a14b"  # image latents only, no CLIP
    assert wan_variant(_config(5120, 40, 48), 1560) is None  # Fun Control: nothing published
    assert wan_variant(_config(128, 2, 16), 4) is None  # the tiny models: the generic rule
    assert all(len(p) == 5 for p in TEACACHE_POLYNOMIALS.values())
    for name in ("wan2.1_t2v_1.3b", "wan2.1_t2v_14b"):
        assert len(MAGCACHE_RATIOS[name]) == 98  # 49 steps x (conditional, unconditional)
    for name in ("wan2.1_i2v_14b_480p", "wan2.1_i2v_14b_720p", "wan2.2_t2v_a14b", "wan2.2_i2v_a14b"):
        assert len(MAGCACHE_RATIOS[name]) == 78  # 40-step runs


RELEASED_SIZE = dict(num_attention_heads=40, attention_head_dim=128, num_layers=40)  # the 14B models


@pytest.mark.parametrize("role, experts, tokens, numbers", [
    ("model", 1, 1560, "wan2.1_t2v_14b"),
    ("model", 2, 1560, "wan2.2_t2v_a14b"),  # a two-expert run of T2V experts
    ("i2v", 1, 1560, "wan2.1_i2v_14b_480p"),
    ("i2v", 1, 3600, "wan2.1_i2v_14b_720p"),
    ("i2v_high", 2, 1560, "wan2.2_i2v_a14b"),
    ("i2v_low", 2, 3600, "wan2.2_i2v_a14b"),
    ("fun_control", 1, 1560, "unpublished"),
])
def test_each_model_kind_takes_its_magnitude_table(tiny_models_root, caplog, role, experts, tokens, numbers):
    """The kind is read from the file (what ``model_image_inputs`` reads); only the size is the released one."""
    from wanmesh.parallel.bench.common import model_config
    from wanmesh.parallel.tiny.files import TINY_FILES
    from wanmesh.parallel.sampling.step_cache import make_rule

    config = model_config(str(tiny_models_root / TINY_FILES[role])) | RELEASED_SIZE
    with caplog.at_level("INFO", logger="wanmesh"):
        rule = make_rule(CacheSettings("magcache", 0.1), SimpleNamespace(config=config), 40, tokens, experts)
    assert rule.numbers == numbers
    if numbers == "unpublished":
        assert rule.ratios is None and "using the generic rule" in caplog.text
    else:
        assert rule.ratios == _nearest(MAGCACHE_RATIOS[numbers][0::2], 40)
        assert f"the published magcache numbers of {numbers}" in caplog.text


def test_the_report_line_names_the_numbers():
    from wanmesh.parallel.cache_settings import describe_report

    report = {"method": "magcache", "computed": 8, "skipped": 2, "skipped_steps": [4, 7], "calls": 16}
    assert describe_report(report | {"numbers": "wan2.2_i2v_a14b"}).endswith(
        "16 transformer calls; the published numbers of wan2.2_i2v_a14b")
    assert describe_report(report | {"numbers": "unpublished"}).endswith(
        "the generic rule (no published numbers for this model)")
    assert describe_report(report | {"numbers": None}).endswith("16 transformer calls")


def test_magnitude_tables_follow_the_step_count():
    table = MAGCACHE_RATIOS["wan2.1_t2v_1.3b"][0::2]
    assert _nearest(table, 50) == [1.0, *table]
    short = _nearest(table, 10)
    assert len(short) == 10 and short[0] == 1.0 and short[-1] == table[-1]
