"""Imports never run back up the layers, never go round in a circle, and every module has
a layer (scripts/import_graph.py holds the table and reads the graph from the source)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
ig = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ig)

GRAPH = ig.graph(ROOT)
HEAVY = ("torch", "vllm", "transformers", "lightning", "datasets", "wandb", "numpy",
         "safetensors")


def test_every_module_has_a_layer():
    assert not ig.unplaced(GRAPH), "add them to scripts/import_graph.py::LAYERS"


def test_no_import_runs_back_up_the_layers():
    assert not ig.upward(GRAPH)


def test_no_circles():
    assert not ig.circles(GRAPH)


def test_no_stage_imports_another_beyond_the_known_ones():
    assert not ig.sideways(GRAPH)
    # each known one is still there (else drop it from SIDEWAYS_KNOWN)
    for a, b in ig.SIDEWAYS_KNOWN:
        assert b in GRAPH[a], (a, b)


def test_the_checks_find_what_they_look_for(tmp_path):
    pkg = tmp_path / "eagle3x"
    (pkg / "stages").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "stages" / "__init__.py").write_text("")
    (pkg / "artifacts.py").write_text("def f():\n    from eagle3x import plan\n")
    (pkg / "plan.py").write_text("from eagle3x.artifacts import f\n")
    (pkg / "stages" / "a.py").write_text("from eagle3x.stages import b\n")
    (pkg / "stages" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from eagle3x import pipeline\n")
    (pkg / "pipeline.py").write_text("from . import plan\n")
    (pkg / "mystery.py").write_text("")
    g = ig.graph(tmp_path)
    assert g["eagle3x.pipeline"] == {"eagle3x.plan"} and g["eagle3x.stages.b"] == set()
    assert ig.circles(g) == [["eagle3x.artifacts", "eagle3x.plan"]]
    assert ig.unplaced(g) == ["eagle3x.mystery"]
    del g["eagle3x.mystery"]
    assert ig.upward(g) == ["eagle3x.artifacts (layer 0) imports eagle3x.plan (layer 1)"]
    assert ig.sideways(g) == ["eagle3x.stages.a imports eagle3x.stages.b"]
    with pytest.raises(AssertionError, match="no layer"):
        ig.layer("eagle3x.mystery")


def _loaded_at_import(module: str) -> tuple:
    """(eagle3x modules, other top-level packages) importing `module` loads: the imports
    at module level (not in functions, not under TYPE_CHECKING), followed through the
    package's own modules and their parent packages."""
    seen, outside, todo = set(), set(), [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:n]) for n in range(1, len(parts))]
        path = ROOT.joinpath(*parts)
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for n in names:
                if n.startswith("eagle3x"):
                    if n in GRAPH:
                        todo.append(n)
                else:
                    outside.add(n.split(".")[0])
    return seen, outside


@pytest.mark.parametrize("module", ["eagle3x.engines.errors", "eagle3x.engines.base",
                                    "eagle3x.engines.options", "eagle3x.stopping",
                                    "eagle3x.job", "eagle3x.hub", "eagle3x.checks.preflight",
                                    "eagle3x.__main__"])
def test_these_modules_import_no_heavy_library(module):
    _, outside = _loaded_at_import(module)
    assert not outside & set(HEAVY), sorted(outside & set(HEAVY))


def test_the_heavy_import_check_sees_one():
    _, outside = _loaded_at_import("eagle3x.engines.hf")
    assert "torch" in outside


def test_bench_imports_nothing_from_tests():
    wrong = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            wrong += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                      if n == "tests" or n.startswith("tests.")]
    assert not wrong, wrong


def test_nothing_in_the_package_imports_its_testing_stand_ins():
    assert not [f"{a} imports {b}" for a, ts in GRAPH.items() for b in ts
                if b.startswith("eagle3x.testing") and not a.startswith("eagle3x.testing")]
