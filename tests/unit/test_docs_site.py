"""The documentation site (mkdocs.yml, docs/site_hooks.py): ``mkdocs build --strict`` builds it from the repository
alone, so a broken link or anchor in README.md or docs/ fails this test; the hook's link rewriting (front page,
pages, source files) and its refusal of a link to no file."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = "https://example.org/wanmesh"


@pytest.fixture(scope="module")
def hooks():
    spec = importlib.util.spec_from_file_location("site_hooks", ROOT / "docs" / "site_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strictly_with_the_readme_as_front_page(tmp_path: Path):
    site = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, build.stdout + build.stderr
    front = (site / "index.html").read_text(encoding="utf-8")
    assert "Which layout for my GPUs" in front and 'href="models/#vace"' in front
    for page in ("nodes", "models", "command-line", "troubleshooting", "architecture"):
        assert (site / page / "index.html").is_file(), page


def test_links_are_rewritten_for_the_site(hooks):
    assert hooks.site_target("index.md", "docs/models.md#vace", REPOSITORY) == "models.md#vace"
    assert hooks.site_target("index.md", "docs/t2v_workflow.png", REPOSITORY) == "t2v_workflow.png"
    assert hooks.site_target("parallelism.md", "../README.md#which-layout-for-my-gpus",
                             REPOSITORY) == "index.md#which-layout-for-my-gpus"
    assert hooks.site_target("models.md", "nodes.md", REPOSITORY) == "nodes.md"
    assert hooks.site_target("models.md", "#vace", REPOSITORY) == "#vace"
    assert hooks.site_target("models.md", "../tests/unit/test_docs.py",
                             REPOSITORY) == f"{REPOSITORY}/blob/main/tests/unit/test_docs.py"
    assert hooks.site_target("models.md", "../workflows", REPOSITORY) == f"{REPOSITORY}/tree/main/workflows"


def test_a_link_to_no_file_stops_the_build(hooks):
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match="no_such_page.md"):
        hooks.site_target("models.md", "no_such_page.md#x", REPOSITORY)


def test_headings_get_githubs_anchors(hooks):
    assert hooks.github_slug("Wan 2.2 A14B: two experts") == "wan-22-a14b-two-experts"
    assert hooks.github_slug("a -- b") == "a----b"  # GitHub keeps each hyphen; Python-Markdown would give "a-b"
