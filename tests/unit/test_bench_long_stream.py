"""`wanmesh bench long-stream` on the tiny preset, 3x a trained length of 6 latent frames: the rolling windows'
KV cache stays at its first window's size to the end (the re-anchored one holds one copy of the sink's keys more),
the whole-video cache is larger, the three streams agree before the window first rolls, the edge figures are
finite, and the JSON holds what the table shows."""

from __future__ import annotations

import json
import math

from wanmesh.parallel.cli import main

TRAINED, TIMES, CHUNK, SINK = 6, 3, 2, 1


def test_long_stream_memory_is_flat_with_a_window_and_the_table_and_json_agree(tmp_path, capsys):
    out = tmp_path / "long.json"
    assert main(["bench", "long-stream", "--trained", str(TRAINED), "--times", str(TIMES), "--chunk", str(CHUNK),
                 "--sink", str(SINK), "--steps", "1", "--json", str(out), "--quiet"]) == 0
    table = capsys.readouterr().out
    saved = json.loads(out.read_text())
    results = saved["results"]
    assert saved["chunks"] == TRAINED * TIMES // CHUNK
    whole, window, anchored = (results[name]["cache"] for name in
                               ("whole video cached", "rolling window", "re-anchored window"))
    assert window["first_window"] == window["last_quarter"] and window["growth_per_100_chunks"] == 0
    assert whole["last_quarter"] == TIMES * window["last_quarter"]  # the whole video against a window of its third
    sink_keys = window["last_quarter"] / TRAINED / 2 * SINK  # keys (half of keys and values) of the sink's frames
    assert math.isclose(anchored["last_quarter"], window["last_quarter"] + sink_keys)
    first = {name: result["edge"]["within_first_window"] for name, result in results.items()}
    assert len(set(first.values())) == 1, first  # nothing differs before the window rolls
    assert all(math.isfinite(value) for result in results.values() for value in result["edge"].values())
    for name in results:
        assert name in table
    assert f"{TRAINED * TIMES} latent frames ({TIMES}x the trained {TRAINED})" in table
