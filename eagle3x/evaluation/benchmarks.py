"""Benchmark prompt sets: the registry of sets users cite, resolving `eval.benchmarks`
entries, checking them at startup, and reading their prompts.

An entry of `eval.benchmarks` is one of

    held_out          the first held-out conversations of this run's data (their prompts
                      before the first trained token, as prepared)
    a registry key    a public set (`REGISTRY`: hub name, config, split, field, how a
                      prompt is built), read through the same reader as data=hf: the hub's
                      commit or the newest copy in the local datasets cache (offline)
    an eval.sets key  a set of the user's: {path: <jsonl or datasets folder> | name:
                      <hub dataset>, config, split, field, build}
    a path            a local jsonl file or datasets folder, its field found by name
                      (`AUTO_FIELDS`)

A prompt is a list of user turns (`Prompt.turns`); a set with two turns (MT-Bench) is
served as two prompts, the second following the verifier's own greedy reply to the first
(`eagle3x.evaluation.served`). Turns are rendered by the verifier's chat template with
data.chat_template_kwargs, as served.

Nothing heavy is imported at module level: the startup checks (`problems`) read a jsonl
file's first record, or a datasets folder's / the cache's dataset_info.json features.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

HELD_OUT = "held_out"

#: How a record's field becomes user turns.
BUILDS = ("text", "turns", "alpaca", "humaneval")

#: Fields tried, in order, for a set whose field is not given.
AUTO_FIELDS = ("prompt", "question", "instruction", "problem", "turns", "messages",
               "conversations", "input", "text")


@dataclass(frozen=True)
class PromptSet:
    """Where a set's prompts are and how one is built from a record."""

    key: str
    #: hub dataset name (org/name), or None for a local path
    hub: Optional[str] = None
    path: Optional[str] = None
    config: Optional[str] = None
    split: str = "train"
    #: the record's field holding the prompt (None: the first of AUTO_FIELDS present)
    field: Optional[str] = None
    #: text: the field is the user turn; turns: a list of user turns (or a messages
    #: list: the user turns before the first reply); alpaca: instruction + input;
    #: humaneval: the function to complete, asked for in one user turn
    build: str = "text"
    #: what the set is, for the docs table and eval.json
    about: str = ""


#: The public sets eagle3x knows by name (docs/guides/evaluation.md renders this table).
REGISTRY: Dict[str, PromptSet] = {s.key: s for s in [
    PromptSet("mt_bench", hub="HuggingFaceH4/mt_bench_prompts", split="train", field="prompt",
              build="turns", about="MT-Bench, 80 two-turn questions in 8 categories"),
    PromptSet("humaneval", hub="openai/openai_humaneval", config="openai_humaneval",
              split="test", field="prompt", build="humaneval",
              about="HumanEval, 164 Python functions to complete"),
    PromptSet("gsm8k", hub="openai/gsm8k", config="main", split="test", field="question",
              about="GSM8K, grade-school maths word problems (test split, 1319)"),
    PromptSet("math500", hub="HuggingFaceH4/MATH-500", split="test", field="problem",
              about="MATH-500, competition maths problems"),
    PromptSet("alpaca", hub="tatsu-lab/alpaca", split="train", field="instruction",
              build="alpaca", about="Alpaca, single-turn instructions (+ input)"),
]}


@dataclass
class Prompt:
    """One benchmark prompt: its user turns and where it came from (file:line / row)."""

    turns: List[str]
    where: str


@dataclass
class BenchmarkSet:
    """A set's prompts (at most eval.max_prompts) or, for held_out, its token ids."""

    key: str
    spec: Optional[PromptSet]
    prompts: List[Prompt] = field(default_factory=list)
    #: held_out only: the prepared prompts' token ids
    token_prompts: List[List[int]] = field(default_factory=list)


class BenchmarkError(ValueError):
    """A set that cannot be read; the message names the file, row or key."""


# -- resolving entries (startup: no heavy import) -----------------------------------------


def resolve(entry: str, sets: Mapping[str, Any]) -> Optional[PromptSet]:
    """The PromptSet of an eval.benchmarks entry (None: held_out); KeyError if unknown."""
    if entry == HELD_OUT:
        return None
    if entry in sets:
        given = dict(sets[entry] or {})
        unknown = set(given) - {"path", "name", "config", "split", "field", "build"}
        if unknown:
            raise KeyError(f"eval.sets.{entry} has unknown keys {sorted(unknown)} "
                           "(path, name, config, split, field, build)")
        return PromptSet(entry, hub=given.get("name"), path=given.get("path"),
                         config=given.get("config"), split=given.get("split") or "train",
                         field=given.get("field"), build=given.get("build") or "text")
    if entry in REGISTRY:
        return REGISTRY[entry]
    if Path(entry).expanduser().exists():
        return PromptSet(entry, path=str(Path(entry).expanduser()))
    raise KeyError(entry)


def known(sets: Mapping[str, Any]) -> List[str]:
    return [HELD_OUT, *REGISTRY, *sets]


def _first_jsonl_record(path: Path) -> Tuple[Optional[dict], str]:
    from eagle3x import artifacts

    facts = artifacts.input_facts(path)
    where = f"{path}:{facts.first_line}"
    if facts.first_record is None:
        return None, where
    try:
        record = json.loads(facts.first_record.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BenchmarkError(f"{where}: not json ({exc})")
    if not isinstance(record, dict):
        raise BenchmarkError(f"{where}: a record must be a json object")
    return record, where


def _features(info: Path) -> Optional[List[str]]:
    try:
        feats = json.loads(info.read_text(encoding="utf-8")).get("features")
    except (OSError, ValueError):
        return None
    return list(feats) if isinstance(feats, dict) else None


def columns(spec: PromptSet) -> Tuple[Optional[List[str]], str]:
    """The field names of a set's first record (a jsonl file's first line; a datasets
    folder's or the cached hub copy's features), and where they were read; None: unknown
    without reading the data (checked when the prompts are read)."""
    if spec.path is not None:
        p = Path(spec.path)
        if p.is_dir():
            infos = sorted(p.glob("dataset_info.json")) or sorted(p.glob("*/dataset_info.json"))
            return (_features(infos[0]), str(infos[0])) if infos else (None, str(p))
        record, where = _first_jsonl_record(p)
        return (None if record is None else list(record), where)
    from eagle3x.hub import hub_cached

    cached = hub_cached(spec.hub, spec.config, spec.split)
    if cached is None:
        return None, spec.hub or ""
    return _features(cached[1] / "dataset_info.json"), str(cached[1])


def pick_field(spec: PromptSet, names: Sequence[str]) -> Optional[str]:
    """The field a set's prompts are read from, given its records' field names."""
    if spec.field is not None:
        return spec.field if spec.field in names else None
    return next((f for f in AUTO_FIELDS if f in names), None)


def problems(entries: Sequence[str], sets: Mapping[str, Any]) -> List[Tuple[str, str, Optional[str]]]:
    """(value, why, hint) for each entry that cannot be served: unknown (with the closest
    names), a path that is not a jsonl file or datasets folder, a hub set neither cached nor
    reachable, a field absent from its first record, a build eagle3x does not know."""
    from eagle3x.config.problems import closest, did_you_mean

    out: List[Tuple[str, str, Optional[str]]] = []
    for entry in entries:
        try:
            spec = resolve(entry, sets)
        except KeyError as exc:
            if exc.args[0] != entry:
                out.append((entry, str(exc.args[0]), None))
                continue
            near = did_you_mean(closest(entry, known(sets)))
            out.append((entry, "is neither a known benchmark set, an eval.sets entry, nor an "
                               "existing jsonl file or datasets folder",
                        (near + "\n" if near else "") + "known: " + ", ".join(known(sets))))
            continue
        if spec is None:
            continue
        if spec.build not in BUILDS:
            out.append((entry, f"build {spec.build!r} is not one of {', '.join(BUILDS)}", None))
        if spec.path is None and spec.hub is None:
            out.append((entry, "eval.sets entry needs a path (jsonl or datasets folder) or a "
                               "name (hub dataset)", None))
            continue
        if spec.path is not None and not Path(spec.path).exists():
            out.append((entry, f"{spec.path} does not exist", None))
            continue
        if spec.hub is not None and spec.path is None:
            from eagle3x.hub import hub_source

            ref = hub_source(spec.hub, spec.config, spec.split)
            if ref.problem:
                out.append((entry, f"{spec.hub} (config {spec.config}, split {spec.split}) is "
                                   f"{ref.problem}",
                            "cache it where the hub answers (python -c \"import datasets; "
                            f"datasets.load_dataset('{spec.hub}'"
                            + (f", '{spec.config}'" if spec.config else "")
                            + f", split='{spec.split}')\"), or drop it from eval.benchmarks"))
                continue
        try:
            names, where = columns(spec)
        except BenchmarkError as exc:
            out.append((entry, str(exc), None))
            continue
        if names is not None and pick_field(spec, names) is None:
            want = spec.field or " / ".join(AUTO_FIELDS)
            out.append((entry, f"{where}: the first record has no field {want} (it has "
                               f"{', '.join(names)})",
                        f"name the prompt's field: eval.sets.{spec.key}.field=<one of them>"))
    return out


# -- reading prompts (the eval stage) ------------------------------------------------------


def _records(spec: PromptSet, limit: int) -> Iterator[Tuple[str, dict]]:
    from eagle3x.data import conversations as conv

    if spec.path is not None and not Path(spec.path).is_dir():
        n = 0
        for lineno, _, raw in conv.jsonl_lines(spec.path):
            where = f"{spec.path}:{lineno}"
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as exc:
                raise BenchmarkError(f"{where}: not json ({exc})")
            yield where, record
            n += 1
            if n >= limit:
                return
        return
    if spec.path is not None:
        source = conv.Source(path=spec.path)
    else:
        from eagle3x.hub import hub_source

        ref = hub_source(spec.hub, spec.config, spec.split)
        source = conv.Source(name=spec.hub, config=spec.config, split=spec.split,
                             revision=ref.revision, cached=ref.cached)
    for n, (row, record) in enumerate(conv.dataset_rows(source)):
        if n >= limit:
            return
        yield conv.row_where(source, row), dict(record)


def _user_turns(value: Any, where: str, name: str) -> List[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        turns: List[str] = []
        for m in value:  # messages / ShareGPT: the user turns before the first reply
            role = m.get("role", m.get("from"))
            text = m.get("content", m.get("value"))
            if role in ("assistant", "gpt"):
                break
            if role in ("user", "human") and isinstance(text, str):
                turns.append(text)
        if turns:
            return turns[:1]  # later user turns follow replies from the data, not ours
    raise BenchmarkError(f"{where}: field {name!r} is neither a text, a list of user turns, "
                         "nor a messages list with a user turn")


def build_prompt(spec: PromptSet, record: Mapping[str, Any], where: str) -> Prompt:
    """One Prompt from one record (BenchmarkError naming `where` and the field)."""
    name = pick_field(spec, list(record))
    if name is None:
        raise BenchmarkError(f"{where}: no field {spec.field or ' / '.join(AUTO_FIELDS)} "
                             f"(the record has {', '.join(record)})")
    value = record[name]
    if spec.build == "alpaca":
        extra = record.get("input") or ""
        return Prompt([f"{value}\n\n{extra}" if extra else str(value)], where)
    if spec.build == "humaneval":
        return Prompt(["Complete the following Python function. Reply with the whole "
                       f"function in one code block.\n\n```python\n{value}```"], where)
    turns = _user_turns(value, where, name)
    if spec.build == "text":
        turns = turns[:1]
    return Prompt(turns, where)


def read(spec: PromptSet, limit: int) -> List[Prompt]:
    """The first `limit` prompts of a set."""
    out = [build_prompt(spec, record, where) for where, record in _records(spec, limit)]
    if not out:
        raise BenchmarkError(f"{spec.path or spec.hub}: no records")
    return out


def render(tokenizer: Any, turns: Sequence[str], replies: Sequence[str],
           template_kwargs: Optional[Dict[str, Any]]) -> List[int]:
    """Token ids of a prompt as served: user turns with the verifier's replies between them,
    rendered by the verifier's chat template (data.chat_template_kwargs), the generation
    prompt added."""
    from eagle3x.data.chat import render as render_chat

    messages: List[dict] = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    text = render_chat(tokenizer, messages, True, template_kwargs)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def load(entries: Sequence[str], sets: Mapping[str, Any], limit: int,
         held_out: Any) -> List[BenchmarkSet]:
    """The sets of `entries`, each its first `limit` prompts; `held_out(count)` gives the
    held-out prompts' token ids (eagle3x.evaluation.offline.held_out)."""
    out: List[BenchmarkSet] = []
    for entry in entries:
        spec = resolve(entry, sets)
        if spec is None:
            out.append(BenchmarkSet(HELD_OUT, None, token_prompts=held_out(limit)))
        else:
            out.append(BenchmarkSet(entry, spec, prompts=read(spec, limit)))
    return out
