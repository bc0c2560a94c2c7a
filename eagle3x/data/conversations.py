"""Read conversations as users have them into one shape: OpenAI chat messages.

Input shapes (per record, one json object):

- OpenAI messages: ``{"messages": [{"role": "user", "content": "..."}, ...], "tools": [...]}``
  with ``system`` / ``developer`` / ``user`` / ``assistant`` / ``tool`` turns; content a
  string, null, or a list of ``{"type": "text", "text": ...}`` parts (joined by newlines,
  as vLLM's server joins them); assistant turns may carry ``tool_calls``
  (``[{"id", "type": "function", "function": {"name", "arguments"}}]``, content empty or
  null) and ``reasoning_content`` or ``reasoning``; ``tool`` turns ``tool_call_id`` and
  ``name``.
- ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...], "tools": "..."}``
  with ``human`` / ``gpt`` / ``system`` turns and LLaMA-Factory's ``function_call`` (the
  value a json ``{"name", "arguments"}`` or a list of them: an assistant tool-call turn)
  and ``observation`` (a tool result).

A conversation's ``tools`` (a list, or a json string of one) go to the chat template's
``tools`` argument. ``fields`` renames the columns: ``messages`` (the turns), ``tools``,
``system`` (a system prompt put first).

The normal form each conversation is turned into (``Conversation.messages``) is the
OpenAI shape the chat template receives, normalised the way vLLM's server normalises a
request before rendering (renderers/chat_utils.py): content a string, tool-call
arguments parsed from json into an object, reasoning under ``reasoning_content``. It is
itself valid input, so a regenerated file reads back the same.

Refused, naming ``file:line`` and the turn: a malformed tool call (no name, arguments
not a json object), a tool result with no tool call before it (or naming an id no call
has), reasoning on a non-assistant turn, an image (or any non-text) content part (the
verifier is trained on text), an assistant turn with neither text, reasoning nor tool
call, an unknown role, a conversation without an assistant turn.

Sources: a jsonl file, a local ``datasets`` folder (``save_to_disk``), or a dataset on
the Hugging Face hub by name (``hub_rows``; read through ``datasets``, from its local
cache when the hub cannot be reached). Only json is parsed here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "model": "assistant",
                  "system": "system", "developer": "developer",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}
MESSAGE_ROLES = {"user", "assistant", "system", "developer", "tool"}
#: Keys a reasoning trace is read from on an assistant turn (the first present wins).
REASONING_KEYS = ("reasoning_content", "reasoning")
#: Content part types that are not text (refused: eagle3x trains on text).
_TEXT_PART = "text"


class DataError(ValueError):
    """Bad input data; the message starts with `file:line:`."""


@dataclass(frozen=True)
class Fields:
    """Column names of a record (None: the defaults)."""

    messages: Optional[str] = None
    tools: Optional[str] = None
    system: Optional[str] = None


@dataclass
class Conversation:
    line: int
    messages: List[dict]
    #: the conversation's tools, passed to the chat template (None: none)
    tools: Optional[List[dict]] = None

    def record(self) -> Dict[str, Any]:
        """This conversation as an input record (messages shape)."""
        out: Dict[str, Any] = {"messages": self.messages}
        if self.tools:
            out["tools"] = self.tools
        return out


@dataclass
class _Turn:
    """Where a turn is, for error messages."""

    where: str
    index: int
    role: str = ""

    def __str__(self) -> str:
        return f"{self.where}: turn {self.index}" + (f" ({self.role})" if self.role else "")


def _text(value: Any, turn: _Turn, what: str = "content") -> str:
    """A content value as text: a string, null (""), or text parts joined by newlines."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == _TEXT_PART and isinstance(part.get("text"), str):
                texts.append(part["text"])
                continue
            if isinstance(part, dict) and (kind in ("image", "image_url", "input_image")
                                           or "image_url" in part or "image" in part):
                raise DataError(f"{turn}: an image content part ({kind or 'image'}): eagle3x "
                                "prepares text only, and the verifier is trained on text "
                                "tokens (remove the image or the conversation)")
            raise DataError(f"{turn}: {what} part {part!r:.80} is not text "
                            "(expected {\"type\": \"text\", \"text\": ...})")
        return "\n".join(texts)
    raise DataError(f"{turn}: message {what} must be text, got {type(value).__name__}")


def _tool_call(call: Any, k: int, turn: _Turn) -> dict:
    """One tool call in OpenAI shape, arguments parsed into an object."""
    bad = f"{turn}: malformed tool call {k}"
    if not isinstance(call, dict):
        raise DataError(f"{bad}: expected an object, got {type(call).__name__}")
    fn = call.get("function", call if "name" in call else None)
    if call.get("type", "function") != "function" or not isinstance(fn, dict):
        raise DataError(f"{bad}: expected {{\"type\": \"function\", \"function\": "
                        "{\"name\": ..., \"arguments\": ...}}")
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise DataError(f"{bad}: no function name")
    args = fn.get("arguments", fn.get("parameters"))
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise DataError(f"{bad} ({name}): arguments are not valid json ({exc.msg}, "
                            f"column {exc.colno}): {fn.get('arguments')!r:.80}")
    if not isinstance(args, dict):
        raise DataError(f"{bad} ({name}): arguments must be a json object, "
                        f"got {type(args).__name__}")
    out: Dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise DataError(f"{bad} ({name}): id must be a string")
        out["id"] = call["id"]
    return out


def _reasoning(turn_obj: dict, turn: _Turn) -> Optional[str]:
    for key in REASONING_KEYS:
        value = turn_obj.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise DataError(f"{turn}: {key} must be text, got {type(value).__name__}")
        return value
    return None


def _tools(value: Any, where: str) -> Optional[List[dict]]:
    """A conversation's tools list (json string accepted), checked."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: tools is a string but not json ({exc.msg})")
    if not isinstance(value, list):
        raise DataError(f"{where}: tools must be a list of tool definitions, "
                        f"got {type(value).__name__}")
    for k, tool in enumerate(value):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise DataError(f"{where}: tool {k} is not a tool definition "
                            "({\"type\": \"function\", \"function\": {\"name\": ...}})")
    return value or None


def _sharegpt_call(value: Any, turn: _Turn) -> List[dict]:
    """A ShareGPT function_call value: json {name, arguments} or a list of them."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DataError(f"{turn}: malformed tool call: function_call value is not json "
                            f"({exc.msg}, column {exc.colno})")
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise DataError(f"{turn}: malformed tool call: an empty function_call")
    return [_tool_call(c, k, turn) for k, c in enumerate(calls)]


def normalize(record: object, where: str, fmt: str = "auto",
              fields: Optional[Fields] = None) -> Conversation:
    """One record (a parsed json object) as a Conversation (line 0), or DataError naming
    `where` and the turn."""
    fields = fields or Fields()
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a json object, got {type(record).__name__}")
    if fields.messages:
        if fields.messages not in record:
            raise DataError(f"{where}: no {fields.messages!r} column (data.fields.messages; "
                            f"keys: {', '.join(sorted(record)) or 'none'})")
        turns = record[fields.messages]
        sharegpt = fmt == "sharegpt" or (fmt == "auto" and isinstance(turns, list) and turns
                                         and isinstance(turns[0], dict) and "from" in turns[0])
    elif fmt in ("auto", "sharegpt") and "conversations" in record:
        turns, sharegpt = record["conversations"], True
    elif fmt in ("auto", "messages") and "messages" in record:
        turns, sharegpt = record["messages"], False
    else:
        want = {"auto": '"messages" or "conversations"', "sharegpt": '"conversations"',
                "messages": '"messages"'}[fmt]
        raise DataError(f"{where}: no {want} list (keys: {', '.join(sorted(record)) or 'none'})")
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: the conversation is empty or not a list")
    tools = _tools(record.get(fields.tools or "tools"), where)
    out: List[dict] = []
    if fields.system:
        system = record.get(fields.system)
        if system is not None and not isinstance(system, str):
            raise DataError(f"{where}: {fields.system!r} (data.fields.system) must be text")
        if system:
            out.append({"role": "system", "content": system})
    role_key, text_key, roles = (("from", "value", SHAREGPT_ROLES) if sharegpt
                                 else ("role", "content", {r: r for r in MESSAGE_ROLES}))
    # tool calls still waiting for their results: ids (None for calls without one)
    pending: Optional[List[Optional[str]]] = None
    for i, raw in enumerate(turns):
        turn = _Turn(where, i)
        if not isinstance(raw, dict) or role_key not in raw or (
                sharegpt and text_key not in raw):
            raise DataError(f"{turn} needs {role_key!r} and {text_key!r}")
        raw_role = str(raw[role_key]).lower()
        if raw_role not in roles:
            raise DataError(f"{turn} has unknown role {raw[role_key]!r} "
                            f"(known: {', '.join(sorted(roles))})")
        role = roles[raw_role]
        turn.role = role
        msg: Dict[str, Any] = {"role": role}
        if sharegpt and raw_role == "function_call":
            msg["content"] = ""
            msg["tool_calls"] = _sharegpt_call(raw[text_key], turn)
        else:
            value = raw.get(text_key)
            if role == "tool" and isinstance(value, (dict, list)) and not (
                    isinstance(value, list) and all(isinstance(p, dict) and "type" in p
                                                    for p in value)):
                value = json.dumps(value, ensure_ascii=False)  # a structured tool result
            msg["content"] = _text(value, turn)
        reasoning = _reasoning(raw, turn)
        if reasoning is not None and role != "assistant":
            raise DataError(f"{turn}: reasoning on a {role} turn (only assistant turns "
                            "carry reasoning_content / reasoning)")
        if raw.get("tool_calls") and not sharegpt:
            if role != "assistant":
                raise DataError(f"{turn}: tool_calls on a {role} turn (only assistant turns "
                                "call tools)")
            if not isinstance(raw["tool_calls"], list):
                raise DataError(f"{turn}: malformed tool call: tool_calls must be a list")
            msg["tool_calls"] = [_tool_call(c, k, turn) for k, c in enumerate(raw["tool_calls"])]
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if role == "tool":
            call_id = raw.get("tool_call_id")
            if pending is None:
                raise DataError(f"{turn}: a tool result with no tool call before it (the "
                                "turn before the tool results must be an assistant turn "
                                "with tool_calls)")
            if call_id is not None:
                if not isinstance(call_id, str):
                    raise DataError(f"{turn}: tool_call_id must be a string")
                ids = [c for c in pending if c is not None]
                if ids and call_id not in ids:
                    raise DataError(f"{turn}: a tool result for tool_call_id {call_id!r}, "
                                    f"which no tool call before it has (ids: {', '.join(ids)})")
                msg["tool_call_id"] = call_id
        elif role == "assistant" and msg.get("tool_calls"):
            pending = [c.get("id") for c in msg["tool_calls"]]
        else:
            pending = None
        if isinstance(raw.get("name"), str):
            msg["name"] = raw["name"]
        if (role == "assistant" and not msg["content"].strip() and not msg.get("tool_calls")
                and not (reasoning or "").strip()):
            raise DataError(f"{where}: turn {i} is an empty assistant turn (no text, "
                            "reasoning or tool call)")
        out.append(msg)
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant turn, so nothing to learn from")
    return Conversation(0, out, tools)


# -- sources -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """Where conversations come from: a jsonl file, a datasets folder, or a hub dataset."""

    path: Optional[str] = None
    #: hub dataset name (org/name); set instead of path
    name: Optional[str] = None
    config: Optional[str] = None
    split: str = "train"
    streaming: bool = False
    #: the hub revision (commit sha) this run reads, or None: any cached one
    revision: Optional[str] = None
    #: read from the local datasets cache (not the hub)
    cached: bool = False
    format: str = "auto"
    fields: Fields = field(default_factory=Fields)

    @property
    def label(self) -> str:
        return self.name if self.name else str(self.path)

    @property
    def is_jsonl(self) -> bool:
        return self.name is None and self.path is not None and not Path(self.path).is_dir()


def reader(source: Any) -> Source:
    """Where a plan's source (eagle3x.plan.Source) reads its conversations."""
    return Source(path=None if source.path is None else str(source.path), name=source.name,
                  config=source.config, split=source.split, streaming=source.streaming,
                  revision=source.revision, cached=source.cached, format=source.format,
                  fields=Fields(**source.fields))


def parse_line(raw: bytes, where: str, fmt: str, fields: Optional[Fields] = None) -> Conversation:
    """One jsonl line as a Conversation, or DataError naming `where`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not json ({exc.msg}, column {exc.colno})")
    return normalize(record, where, fmt, fields)


def jsonl_lines(path: str | Path, offset: int = 0, line: int = 1
                ) -> Iterator[Tuple[int, int, bytes]]:
    """(line number, byte offset after the line, raw line) for each non-blank line of a
    jsonl file, from byte `offset` (which starts line `line`)."""
    with open(path, "rb") as f:
        f.seek(offset)
        pos = offset
        for lineno, raw in enumerate(f, line):
            pos += len(raw)
            if raw.strip():
                yield lineno, pos, raw


def _iter_jsonl(path: Path, fmt: str, limit: Optional[int],
                fields: Optional[Fields] = None) -> Iterator[Conversation]:
    n = 0
    for lineno, _, raw in jsonl_lines(path):
        conv = parse_line(raw, f"{path}:{lineno}", fmt, fields)
        conv.line = lineno
        yield conv
        n += 1
        if limit is not None and n >= limit:
            return


def dataset_rows(source: Source, start: int = 0) -> Iterator[Tuple[int, dict]]:
    """(row number from 1, record) of a datasets folder or hub dataset, from row `start`."""
    ds = open_dataset(source)
    if start:  # a Dataset selects the rest; an IterableDataset (streaming) skips
        ds = ds.select(range(start, len(ds))) if hasattr(ds, "__len__") else ds.skip(start)
    for i, record in enumerate(ds, start + 1):
        yield i, record


def row_where(source: Source, row: int) -> str:
    return f"{source.label}: row {row}"


def open_dataset(source: Source) -> Any:
    """The `datasets` dataset of a folder or hub source (the split asked for)."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{source.label}: reading a datasets folder or a hub dataset needs the "
                        "`datasets` package (pip install datasets)")
    if source.name is None:
        ds = datasets.load_from_disk(str(source.path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return ds
    if source.cached:  # from the local cache (the commit the plan chose), not the hub
        from datasets.packaged_modules.cache.cache import Cache

        from eagle3x.hub import hub_cache_dir, hub_cached_folder, snake_name

        name = source.name
        folder = hub_cached_folder(name, source.config, source.revision)
        if folder is None:
            raise DataError(f"{name}: the cached copy of commit {source.revision} is gone from "
                            f"{hub_cache_dir()}")
        builder = Cache(cache_dir=str(hub_cache_dir()), dataset_name=snake_name(name.split("/")[-1]),
                        repo_id=name, config_name=folder.parent.parent.name,
                        version=folder.parent.name, hash=folder.name)
        if source.streaming:
            return builder.as_streaming_dataset(split=source.split)
        return builder.as_dataset(split=source.split)
    return datasets.load_dataset(source.name, source.config, split=source.split,
                                 streaming=source.streaming, revision=source.revision)


def iter_conversations(path: str | Path | Source, fmt: str = "auto",
                       limit: Optional[int] = None,
                       fields: Optional[Fields] = None) -> Iterator[Conversation]:
    """Yield conversations from a jsonl file, a datasets folder or a hub dataset, in order."""
    src = path if isinstance(path, Source) else Source(path=str(path), format=fmt,
                                                       fields=fields or Fields())
    if src.is_jsonl:
        yield from _iter_jsonl(Path(src.path), src.format, limit, src.fields)
        return
    for n, (row, record) in enumerate(dataset_rows(src)):
        if limit is not None and n >= limit:
            return
        conv = normalize(record, row_where(src, row), src.format, src.fields)
        conv.line = row
        yield conv


def check_source(path: str | Path, fmt: str = "auto", fields: Optional[Fields] = None,
                 memo: Optional[str | Path] = None) -> Optional[str]:
    """A reason why `path` cannot be read (first record normalised), or None if it looks
    right. A jsonl file is read through artifacts.input_facts (the one read that also
    hashes it), so a check costs no extra read."""
    from eagle3x import artifacts

    p = Path(path)
    if not p.exists():
        return "does not exist"
    if p.is_dir():
        if not ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
            return "is a folder but not a datasets save_to_disk folder (no dataset_info.json)"
        return None
    try:
        facts = artifacts.input_facts(p, memo)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if facts.records == 0:
        return "has no conversations (empty file)"
    if facts.first_record is None:
        return None  # a first line over 1 MiB: checked when prepared
    try:
        parse_line(facts.first_record, f"{p}:{facts.first_line}", fmt, fields)
    except DataError as exc:
        return str(exc)
    return None


def count_records(path: str | Path, memo: Optional[str | Path] = None) -> Optional[int]:
    """Non-empty lines of a jsonl file (None for a datasets folder), from input_facts."""
    from eagle3x import artifacts

    p = Path(path)
    if p.is_dir():
        return None
    return artifacts.input_facts(p, memo).records
