"""The attention benchmark's argument checks, table and plot (no processes)."""

import argparse

import pytest

from wanmesh.parallel.bench.attention import _resolve, add_arguments, format_table, write_plot

ROWS = [
    {"degree": 2, "seq_len": 64, "method": "ring_overlap", "time_ms": 1.5, "sent_bytes": 65536,
     "analytic_bytes": 65536, "note": ""},
    {"degree": 2, "seq_len": 128, "method": "ring_overlap", "time_ms": 3.0, "sent_bytes": 131072,
     "analytic_bytes": 131072, "note": ""},
    {"degree": 2, "seq_len": 64, "method": "torch_cp", "time_ms": None, "sent_bytes": None,
     "analytic_bytes": 65536, "note": "does not run: NotImplementedError"},
]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_table_lists_every_row_with_mib_and_notes():
    table = format_table(ROWS).splitlines()
    assert len(table) == 2 + len(ROWS)
    assert "0.062" in table[2] and "0.125" in table[3]
    assert table[4].split()[3] == "-" and "does not run: NotImplementedError" in table[4]


def test_plot_is_written_as_png(tmp_path):
    path = tmp_path / "bench.png"
    write_plot(ROWS, path, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--degrees", "1,2"], "at least 2"),
        (["--degrees", "two"], "comma-separated integers"),
        (["--seq-lens", "2,3", "--degrees", "4"], "at least the largest degree"),
        (["--repeats", "0"], "must be positive"),
        (["--methods", "ring_overlap,bogus"], "not a subset of ring_overlap"),
    ],
)
def test_bad_settings_are_rejected_before_spawning(argv, message):
    with pytest.raises(ValueError, match=message):
        _resolve(_args("--device", "cpu", *argv))


def test_defaults_on_cpu():
    settings = _resolve(_args("--device", "cpu"))
    assert settings["degrees"] == [2, 4] and settings["dtype"] == "float32" and settings["seq_lens"] == [512, 1024, 2048]
