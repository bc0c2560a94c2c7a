"""The stage graph is the one list of stages (the layers: tests/test_layers.py)."""

from __future__ import annotations

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
    assert run(Stage.extract) == ["prepare", "extract"]
    assert run(Stage.vocab) == ["prepare", "vocab"]
    assert run(Stage.export) == ["prepare", "vocab", "export"]
    assert run(Stage.regenerate) == ["regenerate"] and run(Stage.prepare) == ["prepare"]
    assert BY_NAME["eval"].before == ()


def test_what_a_stage_runs_first_is_closed():
    """One rule for every stage: what it runs first includes what those run first."""
    for spec in STAGES:
        for name in spec.before:
            assert set(BY_NAME[name].before) <= set(spec.before), (spec.name, name)


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


def test_nothing_under_data_imports_stages():
    for path in (PACKAGE / "data").rglob("*.py"):
        assert "eagle3x.stages" not in path.read_text(), path


def test_online_hidden_states_leave_extract_out_unless_it_is_asked_for():
    from tests.helpers import settings_for

    online = settings_for(["stage=all", "hidden=online"])
    assert [s.name for s in stages_for(Stage.all, online)] == ["prepare", "vocab", "train", "eval"]
    assert [s.name for s in stages_for(Stage.train, online)] == ["prepare", "vocab", "train"]
    assert [s.name for s in stages_for(Stage.extract, online)] == ["prepare", "extract"]
    offline = settings_for(["stage=all"])
    assert "extract" in [s.name for s in stages_for(Stage.all, offline)]
