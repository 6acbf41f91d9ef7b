"""The package's shape: ComfyUI's start-up import stays light, module-level imports have no cycles, and every
module says what it is for and which process runs it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACK_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "wanmesh"
HEAVY = ("diffusers", "transformers", "accelerate", "cv2", "ray")
SOURCE_DIRS = ("nodes", "parallel")
PROCESS_WORDS = ("driver", "worker", "ComfyUI", "CLI", "both", "ranks")

# Imports the pack as ComfyUI does (by file path, under the folder's name), with the model libraries made
# unimportable: the pack must register its nodes without them.
COMFYUI_STYLE_IMPORT = """
import importlib.abc, importlib.util, sys
HEAVY = {heavy!r}
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise ImportError(f"{{name}} must not be imported when ComfyUI loads the pack")
sys.meta_path.insert(0, Refuse())
spec = importlib.util.spec_from_file_location("WanMesh-pack", {init!r}, submodule_search_locations=[{root!r}])
module = importlib.util.module_from_spec(spec)
sys.modules["WanMesh-pack"] = module
spec.loader.exec_module(module)
print(len(module.NODE_CLASS_MAPPINGS), sorted(m for m in HEAVY if m in sys.modules))
"""


def test_comfyui_start_up_import_needs_no_model_library():
    code = COMFYUI_STYLE_IMPORT.format(heavy=HEAVY, init=str(PACK_ROOT / "__init__.py"), root=str(PACK_ROOT))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    count, loaded = result.stdout.split(maxsplit=1)
    assert int(count) >= 9 and loaded.strip() == "[]"


def _modules() -> dict[str, Path]:
    found = {}
    for folder in SOURCE_DIRS:
        for path in sorted((PACK_ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(PACK_ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([PACKAGE, *parts])] = path
    return found


def _module_level_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the pack that ``name`` imports when it is executed (imports inside functions do not count)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                targets.add(candidate if candidate in known else base)
        elif isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
    return {t for t in targets if t in known and t != name}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_level_import_cycles():
    modules = _modules()
    graph = {name: _module_level_imports(name, path, set(modules)) for name, path in modules.items()}
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph))}"


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_parallel_never_imports_comfyui_or_the_nodes():
    for name, path in _modules().items():
        if not name.startswith(f"{PACKAGE}.parallel"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                bad = [n for n in names if n.split(".")[0] in ("comfy", "folder_paths", "nodes") and not
                       (isinstance(node, ast.ImportFrom) and node.level)]
                assert not bad, f"{path.relative_to(PACK_ROOT)} imports {bad}"


@pytest.mark.parametrize("path", sorted(p for folder in SOURCE_DIRS for p in (PACK_ROOT / folder).rglob("*.py")),
                         ids=lambda p: str(p.relative_to(PACK_ROOT)))
def test_every_module_says_its_role_and_process(path):
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    assert docstring, f"{path.relative_to(PACK_ROOT)} has no module docstring"
    in_nodes = path.relative_to(PACK_ROOT).parts[0] == "nodes"
    assert in_nodes or any(word in docstring for word in PROCESS_WORDS), (
        f"{path.relative_to(PACK_ROOT)}: the docstring does not say which process runs it")


FILE_FORMAT_LIBRARIES = ("safetensors", "gguf")


def _imports_anywhere(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports, at module level or inside a function, as absolute dotted names."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _reads_files(name: str, path: Path) -> list[str]:
    """What in module ``name`` reads a weight file: an import of the weights package or a file-format library, or a
    call of torch.load."""
    weights = f"{PACKAGE}.parallel.weights"
    bad = sorted(m for m in _imports_anywhere(name, path)
                 if m == weights or m.startswith(weights + ".") or m.split(".")[0] in FILE_FORMAT_LIBRARIES)
    if "torch.load(" in path.read_text(encoding="utf-8"):
        bad.append("torch.load")
    return bad


def test_networks_read_no_weight_file():
    """parallel/networks holds the networks only: no module there imports parallel/weights (files, formats, loaders),
    safetensors or gguf, or calls torch.load; the weights package builds networks from files, never the reverse."""
    networks = {n: p for n, p in _modules().items() if n.startswith(f"{PACKAGE}.parallel.networks")}
    assert len(networks) >= 8
    offenders = {name: bad for name, path in networks.items() if (bad := _reads_files(name, path))}
    assert not offenders, offenders


def test_the_file_reading_check_sees_a_weights_import(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text("def f():\n    from ..weights.checkpoint import CheckpointFile\n    import gguf\n")
    assert _reads_files(f"{PACKAGE}.parallel.networks.probe", module) == sorted([
        f"{PACKAGE}.parallel.weights.checkpoint", f"{PACKAGE}.parallel.weights.checkpoint.CheckpointFile", "gguf"])
