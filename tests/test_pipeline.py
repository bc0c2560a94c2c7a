"""The stage graph is the one list of stages; imports never run back up the layers."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from eagle3x.config.schema import Eagle3xConfig, Stage
from eagle3x.pipeline import BY_NAME, STAGES, stages_for

PACKAGE = Path(__file__).resolve().parents[1] / "eagle3x"


def test_the_stage_enum_and_the_graph_name_the_same_stages_in_order():
    assert [s.value for s in Stage if s is not Stage.all] == [s.name for s in STAGES]


def test_each_stage_gets_exactly_the_sections_its_function_takes():
    sections = {f for f in Eagle3xConfig.__dataclass_fields__}
    for spec in STAGES:
        params = list(inspect.signature(spec.run).parameters)
        assert params[0] == "plan", spec.name
        assert params[1:] == list(spec.sections), spec.name
        assert set(spec.sections) <= sections


def test_stages_run_before_come_earlier_in_the_graph():
    names = [s.name for s in STAGES]
    for spec in STAGES:
        assert all(names.index(b) < names.index(spec.name) for b in spec.before), spec.name


def test_what_each_command_runs():
    def run(stage):
        return [s.name for s in stages_for(stage)]

    assert run(Stage.all) == ["prepare", "extract", "vocab", "train", "eval"]
    assert run(Stage.train) == ["prepare", "extract", "vocab", "train"]
    assert run(Stage.extract) == ["extract"] and run(Stage.export) == ["vocab", "export"]
    assert run(Stage.regenerate) == ["regenerate"] and run(Stage.prepare) == ["prepare"]
    assert BY_NAME["eval"].before == ()


def test_regenerated_replies_put_regenerate_before_prepare():
    from tests.helpers import settings_for

    regen = settings_for(["stage=all", "data.responses=regenerated"])
    assert [s.name for s in stages_for(Stage.all, regen)][:2] == ["regenerate", "prepare"]
    assert [s.name for s in stages_for(Stage.prepare, regen)] == ["regenerate", "prepare"]
    plain = settings_for(["stage=all"])
    assert "regenerate" not in [s.name for s in stages_for(Stage.all, plain)]


def test_help_lists_the_stages_of_the_enum():
    text = (PACKAGE.parent / "conf" / "config.yaml").read_text()
    line = next(x for x in text.splitlines() if x.strip().startswith("Stages:"))
    assert [w.strip() for w in line.split(":", 1)[1].split(",")] == [s.value for s in Stage]


#: Each module's layer; a module may import only from its own layer or below.
LAYERS = [
    ("eagle3x.resources", 0), ("eagle3x.artifacts", 0), ("eagle3x.verifier", 0),
    ("eagle3x.weights", 0), ("eagle3x.tiny", 0), ("eagle3x.serving", 0), ("eagle3x.console", 0),
    ("eagle3x.distributed", 0), ("eagle3x.families", 0), ("eagle3x.failures", 0),
    ("eagle3x.config.problems", 0),
    ("eagle3x.config.schema", 0),
    ("eagle3x.plan", 1), ("eagle3x.config.compose", 1), ("eagle3x.config.rules", 1),
    ("eagle3x.engines", 2), ("eagle3x.draft", 2), ("eagle3x.data", 2),
    ("eagle3x.evaluation", 2),
    ("eagle3x.config.preflight", 3), ("eagle3x.tracking", 3),
    ("eagle3x.stages", 4),
    ("eagle3x.pipeline", 5), ("eagle3x.stopping", 5),
    ("eagle3x.__main__", 6), ("eagle3x.compare", 6), ("eagle3x.inspect", 6),
]


def layer(module: str) -> int:
    for prefix, rank in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return rank
    raise AssertionError(f"{module} has no layer in tests/test_pipeline.py::LAYERS")


def test_no_import_runs_back_up_the_layers():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(p for p in rel.parts if p != "__init__")
        if module == "eagle3x":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle3x"):
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("eagle3x")]
            for t in targets:
                try:
                    if layer(t) > layer(module):
                        wrong.append(f"{module} imports {t}")
                except AssertionError:
                    continue  # `from eagle3x.x import name`: the name, not a module
    assert not wrong, wrong


def test_nothing_under_data_imports_stages():
    for path in (PACKAGE / "data").rglob("*.py"):
        assert "eagle3x.stages" not in path.read_text(), path


def test_online_hidden_states_leave_extract_out_unless_it_is_asked_for():
    from tests.helpers import settings_for

    online = settings_for(["stage=all", "hidden=online"])
    assert [s.name for s in stages_for(Stage.all, online)] == ["prepare", "vocab", "train", "eval"]
    assert [s.name for s in stages_for(Stage.train, online)] == ["prepare", "vocab", "train"]
    assert [s.name for s in stages_for(Stage.extract, online)] == ["extract"]
    offline = settings_for(["stage=all"])
    assert "extract" in [s.name for s in stages_for(Stage.all, offline)]
