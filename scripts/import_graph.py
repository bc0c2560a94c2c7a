"""The package's import graph, read from the source (nothing is imported).

    python scripts/import_graph.py [--json]

Prints the modules, each module's layer (`LAYERS` below), the circles (groups of modules that import one another, directly or
through others: strongly connected components of more than one module) and the upward
imports (a module importing one of a higher layer). Every `import` counts, at module
level or inside a function; `from eagle3x.x import name` counts as importing the module
`eagle3x.x.name` when that is a module, else `eagle3x.x`. Imports under
`if TYPE_CHECKING:` are left out: they never run.

Contract: `graph(root)` -> {module: {imported modules}} for every module under
`root/eagle3x`; `layer(module)` -> its layer, AssertionError for a module the table does
not place; `circles(graph)` -> sorted lists of modules; `upward(graph)` -> "a imports b"
lines; `sideways(graph)` -> imports between modules of a package whose modules stand
alone (`stages/`) that `SIDEWAYS_KNOWN` does not list. `tests/test_layers.py` holds the
package to all four with these functions; docs/architecture.md describes the layers.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]

#: Each module's layer, lowest first: a module imports only from its own layer or below.
#: An entry names a module or a package (its modules share its layer); the longest entry
#: that names a module decides. A module no entry names has no layer: the test fails.
LAYERS: Dict[str, int] = {
    "eagle3x": 0, "eagle3x.resources": 0, "eagle3x.artifacts": 0, "eagle3x.verifier": 0,
    "eagle3x.weights": 0, "eagle3x.tiny": 0, "eagle3x.serving": 0, "eagle3x.console": 0,
    "eagle3x.distributed": 0, "eagle3x.families": 0, "eagle3x.failures": 0,
    "eagle3x.hub": 0, "eagle3x.job": 0, "eagle3x.published": 0,
    "eagle3x.config": 0, "eagle3x.config.problems": 0, "eagle3x.config.schema": 0,
    "eagle3x.plan": 1, "eagle3x.config.compose": 1, "eagle3x.config.rules": 1,
    "eagle3x.engines": 2, "eagle3x.draft": 2, "eagle3x.data": 2, "eagle3x.evaluation": 2,
    "eagle3x.checks": 3, "eagle3x.tracking": 3,
    "eagle3x.stages": 4,
    "eagle3x.pipeline": 5, "eagle3x.stopping": 5,
    "eagle3x.__main__": 6, "eagle3x.compare": 6, "eagle3x.inspect": 6,
    "eagle3x.testing": 6, "eagle3x.docs": 6,
}
#: Packages whose modules stand alone: none imports another of the same package.
ALONE = ("eagle3x.stages",)
#: Known imports between such modules, each with why it is still there.
SIDEWAYS_KNOWN = {
    ("eagle3x.stages.train", "eagle3x.stages.vocab"):
        "vocab.load (the vocabulary's reader) lives in the stage module until the "
        "vocabulary building moves to data/ whole",
    ("eagle3x.stages.export", "eagle3x.stages.train"):
        "build_module needs vocab.load: it moves below the stages with it",
}


def layer(module: str) -> int:
    """The module's layer (AssertionError: the table does not place it)."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        name = ".".join(parts[:n])
        if name in LAYERS:
            return LAYERS[name]
    if module in LAYERS:
        return LAYERS[module]
    raise AssertionError(f"{module} has no layer in scripts/import_graph.py::LAYERS")


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    return ".".join(p for p in rel.parts if p != "__init__")


def modules(root: Path = ROOT, package: str = "eagle3x") -> Dict[str, Path]:
    """Every module of `package` under `root`, by dotted name."""
    return {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> Set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` blocks."""
    skip: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skip.update(id(n) for n in ast.walk(child))
    return skip


def imports_of(path: Path, module: str, known: Set[str], package: str = "eagle3x") -> Set[str]:
    """The package's modules `path` imports (see the module docstring for what counts)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    found: Set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            if not (base == package or base.startswith(package + ".")):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package or alias.name.startswith(package + "."):
                    found.add(alias.name)
    found.discard(module)
    return {m for m in found if m in known}


def graph(root: Path = ROOT, package: str = "eagle3x") -> Dict[str, Set[str]]:
    found = modules(root, package)
    known = set(found)
    return {m: imports_of(p, m, known, package) for m, p in found.items()}


def circles(g: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan), sorted.

    A package's `__init__` importing its own modules is not a circle of the layers, so
    edges from a package to the modules under it are left out."""
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in g.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * len(edges)))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def upward(g: Dict[str, Set[str]], layer: Callable[[str], int] = layer) -> List[str]:
    """"a imports b" for each import of a module of a higher layer."""
    return sorted(f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
                  for a, ts in g.items() for b in ts if layer(b) > layer(a))


def sideways(g: Dict[str, Set[str]], known=SIDEWAYS_KNOWN) -> List[str]:
    """"a imports b" between two modules of one `ALONE` package, unless `known`."""
    def home(m: str):
        return next((p for p in ALONE if m.startswith(p + ".")), None)

    return sorted(f"{a} imports {b}" for a, ts in g.items() for b in ts
                  if home(a) is not None and home(a) == home(b) and (a, b) not in known)


def unplaced(g: Dict[str, Set[str]]) -> List[str]:
    """The modules the table gives no layer."""
    out = []
    for m in g:
        try:
            layer(m)
        except AssertionError:
            out.append(m)
    return sorted(out)


def main(argv: List[str]) -> int:
    g = graph()
    missing = unplaced(g)
    report = {
        "modules": len(g),
        "imports": sum(len(t) for t in g.values()),
        "unplaced": missing,
        "circles": circles(g),
        "upward": upward(g) if not missing else None,
        "sideways": sideways(g, {}),
        "layers": {m: layer(m) for m in sorted(g) if m not in missing},
    }
    if "--json" in argv:
        print(json.dumps(report, indent=1))
        return 0
    print(f"modules: {report['modules']}, imports between them: {report['imports']}")
    by: Dict[int, List[str]] = {}
    for m, r in report["layers"].items():
        by.setdefault(r, []).append(m)
    for r in sorted(by):
        print(f"layer {r}: {len(by[r])} modules")
    print(f"modules without a layer: {len(missing)} {' '.join(missing)}")
    print(f"circles: {len(report['circles'])}")
    for c in report["circles"]:
        print("  " + " <-> ".join(c))
    if report["upward"] is not None:
        print(f"upward imports: {len(report['upward'])}")
        for line in report["upward"]:
            print("  " + line)
    print(f"imports between stages: {len(report['sideways'])}")
    for line in report["sideways"]:
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
