"""Layers import only downwards: library <- workers <- coordinator <- composition (specdec.app).

Every `import` in every module of the four packages is read from its syntax tree, including
imports inside functions (a lazy import is still a dependency). The second test plants violations
in a copy of the tree and checks they are caught, so the check cannot pass vacuously.
"""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec", "coordinator", "draft_worker", "target_worker")

# What each layer may import (besides third-party code and itself).
ALLOWED = {
    "library": {"library"},
    "draft_worker": {"library"},
    "target_worker": {"library"},
    "coordinator": {"library"},
    "app": {"library", "draft_worker", "target_worker", "coordinator"},
    "facade": {"library", "app"},  # specdec/__init__.py re-exports what specdec.app assembles
}
# The upper packages' __init__ load the facade first, only to fix the import order (see the
# comment in those files); that one edge is not a use of what the facade exports.
LOAD_ORDER_EDGES = {(f"{pkg}", "specdec") for pkg in ("coordinator", "draft_worker", "target_worker")}


def layer_of(module: str) -> str | None:
    """The layer of a first-party module, or None for third-party code."""
    top = module.split(".")[0]
    if module == "specdec":
        return "facade"
    if module == "specdec.app" or module.startswith("specdec.app."):
        return "app"
    if top == "specdec":
        return "library"
    if top in ("coordinator", "draft_worker", "target_worker"):
        return top
    return None


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path, known: set[str]) -> list[tuple[str, int]]:
    """(module, line) for every import in the file; `from pkg import sub` counts as pkg.sub when
    sub is a module, and relative imports are resolved against the file's package."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in known else base, node.lineno))
    return found


def layering_violations(root: Path) -> list[str]:
    files = [p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))]
    known = {module_name(p, root) for p in files}
    problems = []
    for path in files:
        source = module_name(path, root)
        source_layer = layer_of(source)
        for target, line in imported_modules(path, root, known):
            target_layer = layer_of(target)
            if target_layer is None or target_layer == source_layer:
                continue
            if (source, target) in LOAD_ORDER_EDGES:
                continue
            if target_layer not in ALLOWED[source_layer]:
                rel = path.relative_to(root)
                problems.append(f"{rel}:{line}: {source} ({source_layer}) imports {target} ({target_layer})")
    return problems


def test_layers_import_only_downwards():
    assert layering_violations(ROOT) == []


def test_layer_check_catches_planted_upward_and_sideways_imports(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert layering_violations(tmp_path) == []

    plants = {
        "specdec/kv_cache.py": "from coordinator.scheduler import Scheduler\n",  # library -> coordinator
        "specdec/model/rope.py": "def _lazy():\n    from specdec.app import engine\n",  # lazy, library -> app
        "draft_worker/drafter.py": "import target_worker.worker\n",  # worker -> worker, sideways
        "target_worker/worker.py": "from coordinator import request\n",  # worker -> coordinator
        "coordinator/scheduler.py": "from draft_worker import worker\n",  # coordinator -> worker
        "specdec/tokenizer.py": "from . import app\n",  # relative import of the composition layer
    }
    for rel, line in plants.items():
        path = tmp_path / rel
        path.write_text(path.read_text() + "\n" + line)
    found = layering_violations(tmp_path)
    assert len(found) == len(plants), found
    for rel in plants:
        assert any(f.startswith(rel) for f in found), (rel, found)
