"""``tests/tools/make_workflows.py`` makes exactly the committed example workflows from the live node definitions.

Runs in the test process against both ComfyUI servers (their ``GET /object_info``): the files the generator
writes into a temporary folder must equal those in ``workflows/``, so the examples are regenerable with one
command and no hand edit has drifted from what the nodes declare now.
"""

from __future__ import annotations

from pathlib import Path

from comfyui_server import ComfyUIServer
from make_workflows import EXAMPLES, write_examples
from workflow_graph import WORKFLOWS_DIR


def test_generator_rewrites_the_committed_workflows(comfyui_server: ComfyUIServer,
                                                    recent_comfyui_server: ComfyUIServer, tmp_path: Path) -> None:
    object_info = {"2024": comfyui_server.get_json("/object_info"),
                   "recent": recent_comfyui_server.get_json("/object_info")}

    written = write_examples(object_info, tmp_path)

    assert len(written) == 2 * len(EXAMPLES)
    relative = sorted(str(path.relative_to(tmp_path)) for path in written)
    differing = [name for name in relative
                 if (tmp_path / name).read_text(encoding="utf-8") != (WORKFLOWS_DIR / name).read_text(encoding="utf-8")]
    assert not differing, (f"workflows/ differs from what 'python tests/tools/make_workflows.py' writes: {differing}; "
                           "rerun it and commit the result")
