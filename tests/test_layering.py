"""Layers import only downwards, and no modules import each other in a circle:
library (specdec) <- workers <- coordinator <- composition (specdec_app) <- the `specdec` facade.

Every `import` in every module of the five packages is read from its syntax tree, including
imports inside functions (a lazy import is still a dependency). Planted violations in a copy of
the tree must be caught, so the checks cannot pass vacuously. Importing the library layer must
not load grpc, Ray or fastapi (the facade loads the composition layer only when used).
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec", "coordinator", "draft_worker", "target_worker", "specdec_app")

# What each layer may import (besides third-party code and itself).
ALLOWED = {
    "library": {"library"},
    "draft_worker": {"library"},
    "target_worker": {"library"},
    "coordinator": {"library"},
    "app": {"library", "draft_worker", "target_worker", "coordinator"},
    "facade": {"library", "app"},  # specdec/__init__.py re-exports what specdec_app assembles
}


def layer_of(module: str) -> str | None:
    """The layer of a first-party module, or None for third-party code."""
    top = module.split(".")[0]
    if module == "specdec":
        return "facade"
    if top == "specdec_app":
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


def _graph(root: Path) -> tuple[list[Path], dict[str, list[tuple[str, int]]]]:
    files = [p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))]
    known = {module_name(p, root) for p in files}
    return files, {module_name(p, root): imported_modules(p, root, known) for p in files}


def layering_violations(root: Path) -> list[str]:
    files, graph = _graph(root)
    problems = []
    for path in files:
        source = module_name(path, root)
        source_layer = layer_of(source)
        for target, line in graph[source]:
            target_layer = layer_of(target)
            if target_layer is None or target_layer == source_layer:
                continue
            if target_layer not in ALLOWED[source_layer]:
                rel = path.relative_to(root)
                problems.append(f"{rel}:{line}: {source} ({source_layer}) imports {target} ({target_layer})")
    return problems


def import_circles(root: Path) -> list[list[str]]:
    """Every circle of first-party modules importing one another (strongly connected components
    of more than one module, or a module importing itself)."""
    _, graph = _graph(root)
    edges = {m: {t for t, _ in targets if t in graph and t != m} for m, targets in graph.items()}
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return circles


def test_layers_import_only_downwards():
    assert layering_violations(ROOT) == []


def test_no_modules_import_each_other_in_a_circle():
    assert import_circles(ROOT) == []


def test_the_checks_catch_planted_upward_sideways_and_circular_imports(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert layering_violations(tmp_path) == [] and import_circles(tmp_path) == []

    plants = {
        "specdec/kv_cache.py": "from coordinator.rounds.scheduler import Scheduler\n",  # library -> coordinator
        "specdec/model/rope.py": "def _lazy():\n    from specdec_app import engine\n",  # lazy, library -> app
        "draft_worker/drafter.py": "import target_worker.worker\n",  # worker -> worker, sideways
        "target_worker/worker.py": "from coordinator.rounds import request\n",  # worker -> coordinator
        "coordinator/rounds/scheduler.py": "from draft_worker import worker\n",  # coordinator -> worker
        "specdec/model/weights.py": "from .. import LocalEngine\n",  # relative, upwards: library -> facade
    }
    for rel, line in plants.items():
        path = tmp_path / rel
        path.write_text(path.read_text() + "\n" + line)
    found = layering_violations(tmp_path)
    assert len(found) == len(plants), found
    for rel in plants:
        assert any(f.startswith(rel) for f in found), (rel, found)
    params = tmp_path / "specdec/params.py"
    params.write_text(params.read_text() + "\nfrom specdec import tokenizer\n")  # tokenizer <-> params
    tokenizer = tmp_path / "specdec/tokenizer.py"
    tokenizer.write_text(tokenizer.read_text() + "\nfrom . import params\n")  # (relative)
    assert ["specdec.params", "specdec.tokenizer"] in import_circles(tmp_path)


def test_importing_the_library_loads_no_grpc_ray_or_fastapi():
    """`python -X importtime -c "import specdec.sampling"` (and the model, params, wire): none of
    the service's heavy dependencies, nor the layers above."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-c",
                          "import specdec.sampling, specdec.model, specdec.params, specdec.wire"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    loaded = {line.split("|")[-1].strip().split(".")[0] for line in run.stderr.splitlines() if "|" in line}
    assert not loaded & {"grpc", "ray", "fastapi", "uvicorn", "coordinator", "draft_worker", "target_worker",
                         "specdec_app"}, sorted(loaded & {"grpc", "ray", "fastapi", "uvicorn"})


def test_the_facade_still_exports_the_engine():
    import specdec

    assert {"LocalEngine", "SamplingParams", "ServiceConfig", "GenerationOutput"} <= set(dir(specdec))
    assert specdec.LocalEngine.__module__ == "specdec_app.engine"
