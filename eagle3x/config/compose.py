"""Compose the config the way Hydra will, collecting every problem instead of the first.

Hydra stops at the first bad override with a generic message; eagle3x checks each
override against the schema itself so that the report names every unknown key, wrong
type and misspelt group option at once, with the closest valid choices.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from eagle3x.config.problems import Problem, closest, did_you_mean
from eagle3x.config.schema import ALIASES, GROUPS, OPEN_DICTS

PACKAGE_DIR = Path(__file__).resolve().parent.parent


def conf_dir() -> Path:
    """The folder holding config.yaml: inside the package when installed, else beside it."""
    inside = PACKAGE_DIR / "conf"
    return inside if (inside / "config.yaml").exists() else PACKAGE_DIR.parent / "conf"


def setup() -> None:
    """Register the schema and eagle3x's resolvers (idempotent)."""
    from eagle3x.config.schema import register

    register()
    if not OmegaConf.has_resolver("eagle3x.resource"):
        from eagle3x.resources import resource

        OmegaConf.register_new_resolver("eagle3x.resource", lambda name: str(resource(name)))


def group_options(group: str) -> List[str]:
    """Option names of a config group (the YAML files in conf/<group>/)."""
    folder = conf_dir() / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def all_keys(node: Any, prefix: str = "") -> List[str]:
    """Every dotted key of a config (nodes and leaves), without resolving values."""
    keys: List[str] = []
    if isinstance(node, DictConfig):
        for k in node.keys():
            full = f"{prefix}{k}"
            keys.append(full)
            child = node._get_node(k)
            if isinstance(child, DictConfig):
                keys.extend(all_keys(child, full + "."))
    return keys


def suggest_keys(key: str, valid: Sequence[str]) -> List[str]:
    """Likely intended keys for an unknown `key`: known aliases, near spellings, same leaf."""
    leaf = key.rsplit(".", 1)[-1]
    section = key.rsplit(".", 1)[0] if "." in key else ""
    found: List[str] = []
    aliases = ALIASES.get(leaf.replace("-", "_").lower(), [])
    # Prefer an alias in the section the user typed.
    found += [a for a in aliases if section and a.startswith(section + ".")]
    found += [a for a in aliases if a not in found]
    found += [k for k in valid if k.rsplit(".", 1)[-1] == leaf and k not in found]
    found += [k for k in closest(key, valid, n=3, cutoff=0.6) if k not in found]
    in_section = [k for k in valid if section and k.startswith(section + ".")]
    found += [k for k in closest(key, in_section, n=2, cutoff=0.5) if k not in found]
    return found[:3]


def has_key(cfg: DictConfig, key: str) -> bool:
    """Whether the dotted `key` is declared in `cfg` (set, unset or interpolated)."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node.keys():
            return False
        node = node._get_node(part)
    return True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    text = re.sub(r"\s*full_key:.*", "", text, flags=re.S)
    return text.splitlines()[0] if text else type(exc).__name__


def _type_message(exc: BaseException, node_type: Optional[str]) -> str:
    msg = _first_line(exc)
    if node_type and "expected" not in msg:
        msg = f"{msg} (expected {node_type})"
    return msg


def _node_type(cfg: DictConfig, key: str) -> Optional[str]:
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if not isinstance(parent, DictConfig):
        return None
    node = parent._get_node(leaf)
    if node is None:
        return None
    ref = getattr(node, "_metadata", None)
    t = getattr(ref, "ref_type", None)
    if t is None or t is Any:
        return None
    enum_values = getattr(t, "__members__", None)
    if enum_values:
        return "one of " + ", ".join(enum_values)
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def _compose(overrides: List[str], with_hydra: bool = False) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=with_hydra)


def load_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The composed config for `overrides` (no Hydra job), for scripts, benches and tests."""
    setup()
    return _compose(list(overrides))


def _parse(overrides: Sequence[str]) -> Tuple[list, List[Problem]]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    parsed, problems = [], []
    for raw in overrides:
        try:
            parsed.extend(parser.parse_overrides([raw]))
        except OverrideParseException as exc:
            problems.append(
                Problem(None, f"cannot read this override: {_first_line(exc)}",
                        value=None, where="command line",
                        hint=f"`{raw}`: write overrides as key=value (e.g. extract.batch_size=8)")
            )
    return parsed, problems


def _is_group(name: str) -> bool:
    return name in GROUPS or name.startswith("hydra/")


def _twice(parsed: list) -> List[Problem]:
    problems, seen = [], {}
    for o in parsed:
        name = o.key_or_group
        if name in seen:
            problems.append(Problem(name, f"given twice: as `{seen[name]}` and as `{o.input_line}`.",
                                    where="command line",
                                    hint="keep one of them; eagle3x does not guess which you meant."))
        seen[name] = o.input_line
    return problems


def expand_jobs(overrides: Sequence[str], multirun: bool) -> Tuple[List[List[str]], List[Problem]]:
    """The override list of every job a command line starts (one unless -m sweeps)."""
    parsed, problems = _parse(overrides)
    if problems:
        return [], problems
    problems += _twice(parsed)
    if not multirun or not any(o.is_sweep_override() for o in parsed):
        return [list(overrides)], problems
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    try:
        batches = BasicSweeper.split_arguments(parsed, None)
    except Exception as exc:
        return [], [Problem(None, _first_line(exc), where="command line")]
    return [job for batch in batches for job in batch], problems


def compose_checked(overrides: Sequence[str]) -> Tuple[Optional[DictConfig], List[Problem]]:
    """Compose config.yaml with `overrides`; return (config or None, problems)."""
    setup()
    parsed, problems = _parse(overrides)
    problems += _twice(parsed)
    group_args, value_args = [], []
    for o in parsed:
        name = o.key_or_group
        if _is_group(name):
            options = group_options(name) if name in GROUPS else None
            choice = o.value()
            if options is not None and not o.is_delete() and isinstance(choice, str) and choice not in options:
                hint = did_you_mean(closest(choice, options, cutoff=0.4)) or ""
                hint = (hint + "\n" if hint else "") + f"options of `{name}`: {', '.join(options)}"
                problems.append(Problem(name, f"`{choice}` is not an option of group `{name}`.",
                                        value=str(choice), where="command line", hint=hint))
                continue
            group_args.append(o.input_line)
        else:
            value_args.append(o)
    try:
        base = _compose(group_args)
    except Exception as exc:  # a broken YAML file or group option: report Hydra's words
        return None, problems + [Problem(None, _first_line(exc), where=_where_from(exc),
                                         hint=_hint_from(exc))]
    valid = all_keys(base)
    for o in value_args:
        key = o.key_or_group
        if key.startswith("hydra.") or o.is_delete():
            continue
        open_parent = next((p for p in OPEN_DICTS if key.startswith(p + ".")), None)
        if open_parent and not has_key(base, key):
            if o.is_add():
                OmegaConf.update(base, key, o.value(), merge=True)
                continue
            leaf = key[len(open_parent) + 1:]
            problems.append(Problem(key, f"`{open_parent}` holds your own keys; add one with "
                                         f"`+` (Hydra's rule for new keys).", value=_value_text(o),
                                    where="command line",
                                    hint=f"+{key}={_value_text(o)}  or  "
                                         f"{open_parent}={{{leaf}:{_value_text(o)}}}"))
            continue
        if not has_key(base, key):
            parent = key.rpartition(".")[0]
            where_txt = f"`{parent}` has no key `{key.rpartition('.')[2]}`" if parent in valid \
                else f"no such key `{key}`"
            problems.append(Problem(key, f"unknown key: {where_txt}.", value=_value_text(o),
                                    where="command line",
                                    hint=did_you_mean(suggest_keys(key, valid))))
            continue
        try:
            OmegaConf.update(base, key, o.value(), merge=True)
        except Exception as exc:
            problems.append(Problem(key, "wrong type: " + _type_message(exc, _node_type(base, key)),
                                    value=_value_text(o), where="command line"))
    if problems:
        return None, problems
    try:
        cfg = _compose([o.input_line for o in parsed], with_hydra=True)
    except Exception as exc:
        return None, [Problem(None, _first_line(exc), where=_where_from(exc) or "command line",
                              hint=_hint_from(exc))]
    return cfg, []


def _value_text(o: Any) -> str:
    return o.input_line.split("=", 1)[1] if "=" in o.input_line else ""


def _where_from(exc: BaseException) -> Optional[str]:
    m = re.search(r"In '([^']+)'", str(exc))
    if m:
        return f"conf/{m.group(1)}.yaml"
    return None


def _hint_from(exc: BaseException) -> Optional[str]:
    text = str(exc)
    m = re.search(r"Key '([^']+)' not in '([^']+)'", text)
    if m:
        return f"`{m.group(1)}` is not a key of {m.group(2)}; see `python -m eagle3x --cfg job`."
    m = re.search(r"Available options in '([^']+)':\s*(.*)", text, flags=re.S)
    if m:
        return f"options of `{m.group(1)}`: " + ", ".join(m.group(2).split())
    return None



def typed(cfg: DictConfig) -> Any:
    """The composed config as the schema's dataclasses (``Eagle3xConfig``), values resolved.

    This is where the Hydra config stops: stages and everything below take these typed
    sections (or plain values), never the DictConfig.
    """
    from eagle3x.config.schema import Eagle3xConfig

    job = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Eagle3xConfig), job))
