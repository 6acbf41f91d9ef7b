"""Build hooks of the documentation site (``mkdocs build``, configured by ``mkdocs.yml``), run in mkdocs' process.

The pages are written for reading in the repository (on GitHub or in an editor): a link may point at any file of
the source tree and anchors are GitHub's. The site keeps that meaning: README.md becomes its front page, links
between pages are made relative to the site, a link into the source tree (a test, a module, a workflow) points at
that file in the repository, and headings get GitHub's anchors, so ``mkdocs build --strict`` checks every link and
anchor as they are written. A link to a file that does not exist stops the build.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
FRONT_PAGE = "index.md"
# Fenced code and code spans are matched first so that the links in them stay as they are.
CODE_OR_LINK = re.compile(r"(?P<code>^ *```.*?^ *```[^\n]*$|`[^`\n]+`)"
                          r"|(?P<head>!?\[(?:[^\[\]]|\[[^\]]*\])*\]\()(?P<target>[^()\s]+)(?P<tail>(?:\s+\"[^\"]*\")?\))",
                          re.S | re.M)
SCHEME = re.compile(r"[a-z][a-z0-9+.-]*:")


def github_slug(value: str, separator: str = "-") -> str:
    """GitHub's anchor for a heading's text: lower-cased, punctuation dropped (letters, digits, ``_``, ``-`` and
    spaces stay), each space a hyphen. (Python-Markdown's own collapses runs of hyphens, which GitHub does not.)"""
    return re.sub(r"[^\w\- ]", "", value.strip().lower()).replace(" ", separator)


def on_config(config: Any) -> Any:
    config["mdx_configs"].setdefault("toc", {})["slugify"] = github_slug
    return config


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, FRONT_PAGE, content=README.read_text(encoding="utf-8")))
    return files


def _source_dir(page_uri: str) -> Path:
    """Where the page's Markdown lives in the repository (the front page is README.md, at the top)."""
    return ROOT if page_uri == FRONT_PAGE else (DOCS / page_uri).parent


def site_target(page_uri: str, target: str, repository: str) -> str:
    """The link ``target`` written in page ``page_uri`` as the site needs it."""
    if target.startswith("#") or SCHEME.match(target):
        return target
    file, hash_sign, anchor = target.partition("#")
    path = (_source_dir(page_uri) / file).resolve()
    if not path.exists():
        raise PluginError(f"{page_uri}: the link {target!r} points at {path.relative_to(ROOT)}, which does not exist")
    if path == README:
        site_path = FRONT_PAGE
    elif path.is_relative_to(DOCS):
        site_path = path.relative_to(DOCS).as_posix()
    else:
        kind = "tree" if path.is_dir() else "blob"
        return f"{repository}/{kind}/main/{path.relative_to(ROOT).as_posix()}{hash_sign}{anchor}"
    return posixpath.relpath(site_path, posixpath.dirname(page_uri) or ".") + hash_sign + anchor


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    repository = config["repo_url"].rstrip("/")

    def rewritten(match: re.Match) -> str:
        if match["code"]:
            return match["code"]
        return match["head"] + site_target(page.file.src_uri, match["target"], repository) + match["tail"]

    return CODE_OR_LINK.sub(rewritten, markdown)
