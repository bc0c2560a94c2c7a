"""Read conversations in the two common shapes into one: a list of {role, content} turns.

ShareGPT:        {"conversations": [{"from": "human", "value": "..."}, ...]}
OpenAI messages: {"messages": [{"role": "user", "content": "..."}, ...]}

Sources: a jsonl file (one conversation a line) or a local HF ``datasets`` folder
(``save_to_disk``). Every error names the file and line. Only json is parsed here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "model": "assistant",
                  "system": "system"}
MESSAGE_ROLES = {"user", "assistant", "system"}


class DataError(ValueError):
    """Bad input data; the message starts with `file:line:`."""


@dataclass
class Conversation:
    line: int
    messages: List[dict]


def _content(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts: keep the text ones
        parts = [p.get("text", "") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) == len(value):
            return "".join(parts)
    raise DataError(f"{where}: message content must be text, got {type(value).__name__}")


def normalize(record: object, where: str, fmt: str = "auto") -> List[dict]:
    """One record (a parsed json object) as [{role, content}], or DataError naming `where`."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a json object, got {type(record).__name__}")
    if fmt in ("auto", "sharegpt") and "conversations" in record:
        turns, role_key, text_key, roles = record["conversations"], "from", "value", SHAREGPT_ROLES
    elif fmt in ("auto", "messages") and "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
        roles = {r: r for r in MESSAGE_ROLES}
    else:
        want = {"auto": '"messages" or "conversations"', "sharegpt": '"conversations"',
                "messages": '"messages"'}[fmt]
        raise DataError(f"{where}: no {want} list (keys: {', '.join(sorted(record)) or 'none'})")
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: the conversation is empty or not a list")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise DataError(f"{where}: turn {i} needs {role_key!r} and {text_key!r}")
        raw_role = str(turn[role_key]).lower()
        if raw_role not in roles:
            raise DataError(f"{where}: turn {i} has unknown role {turn[role_key]!r} "
                            f"(known: {', '.join(sorted(roles))})")
        role = roles[raw_role]
        text = _content(turn[text_key], f"{where}: turn {i}")
        if role == "assistant" and not text.strip():
            raise DataError(f"{where}: turn {i} is an empty assistant turn")
        out.append({"role": role, "content": text})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant turn, so nothing to learn from")
    return out


def _iter_jsonl(path: Path, fmt: str, limit: Optional[int]) -> Iterator[Conversation]:
    n = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})")
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not json ({exc.msg}, column {exc.colno})")
            yield Conversation(lineno, normalize(record, where, fmt))
            n += 1
            if limit is not None and n >= limit:
                return


def _iter_datasets(path: Path, fmt: str, limit: Optional[int]) -> Iterator[Conversation]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: a datasets folder needs the `datasets` package "
                        "(pip install datasets)")
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    for i, record in enumerate(ds):
        if limit is not None and i >= limit:
            return
        yield Conversation(i + 1, normalize(record, f"{path}: row {i + 1}", fmt))


def iter_conversations(path: str | Path, fmt: str = "auto",
                       limit: Optional[int] = None) -> Iterator[Conversation]:
    """Yield conversations from a jsonl file or a datasets folder, in file order."""
    p = Path(path)
    if p.is_dir():
        yield from _iter_datasets(p, fmt, limit)
    else:
        yield from _iter_jsonl(p, fmt, limit)


def check_source(path: str | Path, fmt: str = "auto") -> Optional[str]:
    """A reason why `path` cannot be read (first record parsed), or None if it looks right."""
    p = Path(path)
    if not p.exists():
        return "does not exist"
    if p.is_dir():
        if not ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
            return "is a folder but not a datasets save_to_disk folder (no dataset_info.json)"
        return None
    try:
        first = next(_iter_jsonl(p, fmt, 1), None)
    except DataError as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    return "has no conversations (empty file)" if first is None else None


def count_records(path: str | Path) -> Optional[int]:
    """Non-empty lines of a jsonl file (None for a datasets folder)."""
    p = Path(path)
    if p.is_dir():
        return None
    n = 0
    with open(p, "rb") as f:
        for line in f:
            n += bool(line.strip())
    return n
