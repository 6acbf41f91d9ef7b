"""The documentation: README.md stays a short front door, every relative link and #anchor in it and in docs/*.md
resolves (anchors as GitHub makes them from headings), every file in docs/ is linked from another page, and the
parts that restate the code stay in step with it: the generated tables (docs/generate.py), the nodes at a glance,
the example workflows, the main job's torch pin and the benchmark list of the usage block."""

from __future__ import annotations

import importlib.util
import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
MARKDOWN = [README, ROOT / "ARCHITECTURE.md", *PAGES]
MAX_README_LINES = 250
FENCE = re.compile(r"^ *```.*?^ *```[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]+`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#* *$", re.M)


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """``text`` without fenced code and with each inline code span blanked: links in code are not links."""
    return CODE_SPAN.sub("`code`", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, punctuation dropped (letters, digits, ``_``,
    ``-`` and spaces stay), spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: Counter[str] = Counter()
    result = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        result.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return result


def links(path: Path) -> list[str]:
    return [target for target in LINK.findall(_prose(path.read_text(encoding="utf-8")))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not checked here


def _target(source: Path, link: str) -> tuple[Path, str]:
    file, _, anchor = link.partition("#")
    return ((source.parent / file).resolve() if file else source), anchor


def test_the_readme_is_a_short_front_door():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {MAX_README_LINES})"


def test_the_slug_rule_matches_githubs():
    assert slug("Wan 2.2 A14B: two experts") == "wan-22-a14b-two-experts"
    assert slug("ComfyUI's MODEL nodes on the WanMesh MODEL") == "comfyuis-model-nodes-on-the-wanmesh-model"
    assert slug("`bench real-size`") == "bench-real-size"
    assert slug("Checks, outputs and exit codes") == "checks-outputs-and-exit-codes"


@pytest.mark.parametrize("path", MARKDOWN, ids=_name)
def test_every_relative_link_and_anchor_resolves(path: Path):
    broken = []
    for link in links(path):
        target, anchor = _target(path, link)
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and (target.suffix != ".md" or anchor not in anchors(target)):
            broken.append(f"{link} (no heading with that anchor in {_name(target)})")
    assert not broken, f"{_name(path)}: {broken}"


def test_every_docs_file_is_linked_from_another_page():
    linked = {_target(path, link)[0] for path in MARKDOWN for link in links(path) if _target(path, link)[0] != path}
    files = [path for path in DOCS.iterdir() if path.is_file() and path.suffix != ".py"]
    assert len(files) > 10
    orphans = [_name(path) for path in files if path.resolve() not in linked]
    assert not orphans, f"docs files no page links to: {orphans}"


def test_each_page_has_one_title():
    for path in PAGES:
        titles = re.findall(r"^# ", FENCE.sub("", path.read_text(encoding="utf-8")), re.M)
        assert len(titles) == 1, f"{_name(path)} has {len(titles)} top-level headings"


# -- the parts that restate the code ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generate():
    spec = importlib.util.spec_from_file_location("wanmesh_docs_generate", DOCS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", ["settings.md", "nodes.md", "command-line.md"])
def test_the_generated_parts_are_their_sources(generate, page: str):
    assert page in generate.PAGES
    text = (DOCS / page).read_text(encoding="utf-8")
    assert generate.generated(page, text) == text, (
        f"docs/{page} differs from the code it is written from; run `python docs/generate.py`")


def test_the_node_reference_has_every_node(generate):
    classes, names = generate.node_definitions()
    text = (DOCS / "nodes.md").read_text(encoding="utf-8")
    reference = text[text.index("<!-- nodes reference"):]
    assert re.findall(r"^### (.+)$", reference, re.M) == list(names.values())
    at_a_glance = re.findall(r"^\| \[(WanMesh [^\]]+)\]\(#([\w-]+)\) \|", text, re.M)
    assert sorted(name for name, _ in at_a_glance) == sorted(names.values()), \
        "docs/nodes.md's table at a glance and the node definitions name different nodes"
    assert all(anchor == slug(name) for name, anchor in at_a_glance)


def test_the_workflow_table_lists_every_example_workflow():
    text = README.read_text(encoding="utf-8")
    listed = re.findall(r"^\| `([\w/]+)` \|", text, re.M)
    assert len(listed) == len(set(listed))
    on_disk = sorted(str(path.relative_to(ROOT / "workflows").with_suffix(""))
                     for folder in (ROOT / "workflows", ROOT / "workflows" / "native") for path in folder.glob("*.json"))
    assert sorted(listed) == on_disk, "README.md's workflow table and workflows/ disagree"
    for name in listed:
        folder, _, stem = name.rpartition("/")
        assert (ROOT / "workflows" / folder / "api" / f"{stem}.json").is_file(), f"{name} has no API form"


def test_the_main_job_pins_the_torch_the_tests_install():
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## The two commands"):text.index("\n## ", text.index("## The two commands"))]
    blocks = re.findall(r"^```bash\n(.*?)\n```$", section, re.S | re.M)
    assert len(blocks) == 2 and blocks[1] == "bash tests/run.sh", blocks
    main_job = re.fullmatch(r"pip install (torch==\S+) && pip install -e \. && wanmesh generate .+", blocks[0])
    assert main_job, blocks[0]
    pins = set(re.findall(r"torch==[\w.+]+", (ROOT / "tests" / "run.sh").read_text(encoding="utf-8")))
    assert pins == {main_job.group(1)}, f"README's main job installs {main_job.group(1)}, tests/run.sh {pins}"


def test_the_usage_names_every_benchmark():
    from wanmesh.parallel.cli.parser import BENCHMARKS

    text = (DOCS / "command-line.md").read_text(encoding="utf-8")
    named = re.search(r"^wanmesh bench (.+) \[options\]$", text, re.M).group(1)
    names = {re.sub(r"\[.*?\]", "", name).strip() for name in named.split("|")}
    assert names == set(BENCHMARKS), f"the usage's `wanmesh bench` list differs by {names ^ set(BENCHMARKS)}"


def test_the_paths_the_pages_name_exist():
    """A repository file named in code (`tests/comfyui/test_fun_camera.py`) exists: moved or renamed files show."""
    missing = []
    for path in MARKDOWN:
        for name in re.findall(r"`((?:parallel|nodes|tests|workflows|docs)/[\w./-]+\.(?:py|sh|json|yaml|md|png))`",
                               path.read_text(encoding="utf-8")):
            if not (ROOT / name).exists():
                missing.append(f"{_name(path)}: {name}")
    assert not missing, missing
