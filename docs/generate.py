"""Write the generated parts of the documentation: the settings table (from ``parallel/fields.py``), the node
reference (from the node definitions) and the command line's flag and benchmark tables (from its parser).

``python docs/generate.py`` rewrites them in place, between their markers; ``--check`` only says which differ
(exit 1). Run it with WanMesh importable as ``wanmesh`` (``pip install -e .``). tests/unit/test_docs.py and
tests/unit/test_fields.py fail when a page differs from what this writes.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import types
from pathlib import Path
from typing import Any, Callable, Iterator

DOCS = Path(__file__).resolve().parent
MAX_SEED = 2**64 - 1
# Node inputs that list files from ComfyUI's model folders: their choices depend on the machine.
FILE_LISTS = {"model_name", "vace_module", "vae_name", "lora_name", "text_encoder_name", "clip_name"}
COMMANDS = ("make-tiny", "generate", "stream")


def _start(name: str) -> str:
    return f"<!-- {name}: python docs/generate.py -->"


def _end(name: str) -> str:
    return f"<!-- end of {name} -->"


def with_block(text: str, start: str, end: str, body: str) -> str:
    """``text`` with what stands between the markers ``start`` and ``end`` replaced by ``body``."""
    head, tail = text.index(start) + len(start), text.index(end)
    return f"{text[:head]}\n{body}\n{text[tail:]}"


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _number(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value == MAX_SEED:
        return "2**64-1"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:g}"
    return str(value)


def _value(value: Any) -> str:
    return f"`{value!r}`" if isinstance(value, str) else f"`{_number(value)}`"


# -- nodes -------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _without_comfyui() -> Iterator[None]:
    """The nodes as they are without ComfyUI: an empty ``folder_paths`` (no model files) and no ``comfy`` package
    (the sampler lists hold WanMesh's own names only), so the reference is the same on every machine."""
    stub = types.ModuleType("folder_paths")
    stub.folder_names_and_paths = {name: ([], set()) for name in ("diffusion_models", "text_encoders", "vae", "loras")}
    stub.get_filename_list = lambda name: []
    stub.get_full_path = lambda name, file: None
    names = ("folder_paths", "comfy", "comfy.samplers")
    saved = {name: sys.modules.get(name, ...) for name in names}
    sys.modules.update({"folder_paths": stub, "comfy": None, "comfy.samplers": None})
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is ...:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def node_definitions() -> tuple[dict[str, type], dict[str, str]]:
    """The pack's node classes and display names."""
    with _without_comfyui():
        from wanmesh.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    return NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS


def _input_row(name: str, spec: tuple, optional: bool) -> str:
    kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
    default = options.get("default")
    if isinstance(kind, list):
        if name in FILE_LISTS:
            kind_text = "file"
            widget = "files in ComfyUI's model folders" + (" or `none`" if "none" in kind else "")
        else:
            kind_text = "choice"
            widget = ", ".join(f"`{choice}`" for choice in kind)
            if default is None and kind:
                default = kind[0]  # ComfyUI's default for a list without one
    else:
        kind_text = kind
        ends = [options.get(key) for key in ("min", "max")]
        widget = "..".join(_number(end) for end in ends) if None not in ends else ""
        if options.get("step") is not None:
            widget += f", step {_number(options['step'])}"
        if options.get("multiline"):
            widget = "multiline text"
    default_text = "" if default is None else _value(default)
    label = f"`{name}`" + (" (optional)" if optional else "")
    return "| " + " | ".join(_cell(part) for part in (label, kind_text, default_text, widget,
                                                         options.get("tooltip", ""))) + " |"


def _node_section(node_id: str, cls: type, display: str) -> list[str]:
    with _without_comfyui():
        spec = cls.INPUT_TYPES()
    lines = [f"### {display}", "", f"`{node_id}`, in ComfyUI's **{cls.CATEGORY}** menu. {cls.DESCRIPTION}", ""]
    rows = [_input_row(name, value, section == "optional")
            for section in ("required", "optional") for name, value in spec.get(section, {}).items()]
    if rows:
        lines += ["| input | type | default | widget | what it is |", "|---|---|---|---|---|", *rows, ""]
    types_ = tuple(cls.RETURN_TYPES)
    if not types_:
        lines += ["No outputs" + (": an output node (it saves and shows its result)." if getattr(cls, "OUTPUT_NODE",
                                                                                                  False) else "."), ""]
        return lines
    names, tips = getattr(cls, "RETURN_NAMES", None), getattr(cls, "OUTPUT_TOOLTIPS", None)
    if names or tips:
        names = tuple(names or (kind.lower() for kind in types_))
        tips = tuple(tips or ("",) * len(types_))
        lines += ["| output | type | what it is |", "|---|---|---|"]
        lines += ["| " + " | ".join(_cell(part) for part in (f"`{name}`", kind, tip)) + " |"
                  for name, kind, tip in zip(names, types_, tips)]
    else:
        lines.append(("Output: " if len(types_) == 1 else "Outputs: ") + ", ".join(f"`{kind}`" for kind in types_) + ".")
    if getattr(cls, "OUTPUT_NODE", False):
        lines += ["", "An output node: it also saves and shows its result."]
    return lines + [""]


def nodes_reference() -> str:
    """Every node's section: id, menu, description, inputs with their widgets and tooltips, outputs."""
    classes, names = node_definitions()
    lines: list[str] = []
    for node_id, cls in classes.items():
        lines += _node_section(node_id, cls, names[node_id])
    return "\n".join(lines).rstrip("\n")


# -- the command line --------------------------------------------------------------------------------------------


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from wanmesh.parallel.cli.parser import build_parser

    parser = build_parser(bench_options=False)
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _flag_row(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    if action.option_strings:
        name = ", ".join(f"`{flag}`" for flag in action.option_strings)
        value = "" if action.nargs == 0 else formatter._format_args(
            action, formatter._get_default_metavar_for_optional(action))
    else:
        name, value = f"`{action.dest}`", formatter._format_args(action, action.dest.upper())
    value = f"`{value}`" if value else ""
    text = formatter._expand_help(action) if action.help else ""
    return "| " + " | ".join(_cell(part) for part in (name, value, text)) + " |"


def command_line_flags() -> str:
    """One table per command: every flag (aliases together), the value it takes and its help."""
    lines: list[str] = []
    for command, parser in _subcommands().items():
        if command not in COMMANDS:
            continue
        rows = [_flag_row(parser, action) for action in parser._actions if not isinstance(action, argparse._HelpAction)]
        lines += [f"### `wanmesh {command}`", "", "| flag | value | what it does |", "|---|---|---|", *rows, ""]
    return "\n".join(lines).rstrip("\n")


def benchmarks_table() -> str:
    """The benchmarks, one row each, with the line ``wanmesh bench --help`` gives."""
    from wanmesh.parallel.cli.parser import BENCHMARKS

    rows = [f"| `wanmesh bench {name}` | {_cell(help_text)} |" for name, (_, help_text) in BENCHMARKS.items()]
    return "\n".join(["| benchmark | what it measures |", "|---|---|", *rows])


# -- the pages ---------------------------------------------------------------------------------------------------


def _settings(text: str) -> str:
    from wanmesh.parallel import fields

    return fields.page_with_table(text)


def _block(name: str, make: Callable[[], str]) -> Callable[[str], str]:
    return lambda text: with_block(text, _start(name), _end(name), make())


PAGES: dict[str, tuple[Callable[[str], str], ...]] = {
    "settings.md": (_settings,),
    "nodes.md": (_block("nodes reference", nodes_reference),),
    "command-line.md": (_block("benchmarks", benchmarks_table), _block("flags", command_line_flags)),
}


def generated(page: str, text: str) -> str:
    """``text`` (the page ``page``) with its generated parts written anew."""
    for rewrite in PAGES[page]:
        text = rewrite(text)
    return text


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for page in PAGES:
        path = DOCS / page
        text = path.read_text(encoding="utf-8")
        new = generated(page, text)
        if new != text:
            stale.append(page)
            if not check:
                path.write_text(new, encoding="utf-8")
    verb = "differs from its sources" if check else "rewritten"
    for page in stale:
        print(f"docs/{page} {verb}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
