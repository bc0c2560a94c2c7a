"""Checks of the composed config alone: required keys, and each field's Rule from the schema.

The rules are declared beside their fields in ``schema.py`` (``checked(...)``,
``at_least(...)``); this module only walks the schema and applies them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from eagle3x.config.problems import Problem
from eagle3x.config.schema import RULE, Eagle3xConfig, Rule, Stage


def declared_rules(schema: type = Eagle3xConfig, prefix: str = "") -> Iterator[Tuple[str, Rule]]:
    """(dotted key, rule) for every field of the schema that declares one, in schema order."""
    for f in dataclasses.fields(schema):
        key = prefix + f.name
        if RULE in f.metadata:
            yield key, f.metadata[RULE]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            yield from declared_rules(type(default), key + ".")


def check_values(cfg: DictConfig, need_stage: bool = True) -> List[Problem]:
    """Problems visible in the config alone: missing required keys and values breaking a rule."""
    problems: List[Problem] = []
    if need_stage and OmegaConf.is_missing(cfg, "stage"):
        problems.append(Problem("stage", "no stage given.",
                                hint="choose one: " + ", ".join(f"stage={s.name}" for s in Stage)))
    job_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
    broken = _unresolvable(job_cfg)
    if broken is not None:  # an interpolation giving a value its field cannot hold
        return problems + [broken]
    for key in sorted(OmegaConf.missing_keys(job_cfg)):
        if key != "stage":
            problems.append(Problem(key, "required, and not set.",
                                    hint=f"set it on the command line: {key}=..."))
    for key, rule in declared_rules():
        try:
            value = OmegaConf.select(cfg, key, throw_on_missing=True)
        except Exception:
            continue
        if isinstance(value, DictConfig) or not _holds(rule, value):
            problems.append(Problem(key, rule.why + ".", value=_show(value),
                                    where=_environment_source(cfg, key)))
    return problems


def _unresolvable(job_cfg: DictConfig) -> Optional[Problem]:
    """The first interpolation (``${oc.env:X}``, ``${other.key}``) whose value its typed
    field refuses, as a Problem naming the key; None when every one resolves."""
    from omegaconf.errors import OmegaConfBaseException

    try:  # as `compose.typed` will: the values merged into the schema, then resolved
        merged = OmegaConf.merge(OmegaConf.structured(Eagle3xConfig), job_cfg)
        OmegaConf.to_container(merged, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as exc:
        key = str(getattr(exc, "full_key", "") or "") or "config"
        why = str(exc).splitlines()[0].rstrip(".")
        return Problem(key, why + ".", where=_environment_source(job_cfg, key))
    return None


def _environment_source(cfg: DictConfig, key: str) -> Optional[str]:
    """'environment variable X' when the value of `key` came from ${oc.env:X,...} and X is set."""
    import os
    import re

    parent, _, leaf = key.rpartition(".")
    try:
        node = (OmegaConf.select(cfg, parent) if parent else cfg)._get_node(leaf)
        raw = node._value() if node is not None else None
    except Exception:
        return None
    found = re.match(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)", str(raw)) if isinstance(raw, str) else None
    if found and found.group(1) in os.environ:
        return f"from environment variable {found.group(1)}={os.environ[found.group(1)]!r}"
    return None


def _holds(rule: Rule, value: Any) -> bool:
    try:
        return bool(rule.ok(value))
    except TypeError:
        return False


def _show(value: Any) -> str:
    return str(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)
