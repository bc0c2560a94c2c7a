"""Chat templating with a loss mask on exactly the tokens the verifier generates.

The template renders what vLLM's server renders (``template_messages``: reasoning under
``reasoning_content``, ``reasoning`` and ``thinking``, the keys templates read; tool-call
arguments as objects, or as json strings for templates that concatenate them, as
DeepSeek's do; the conversation's ``tools`` as ``tools=``).

Where a reply is. Serving assistant turn i sends the render of ``messages[:i]`` with the
generation prompt (P_i) and the model writes the reply G_i: its reasoning, text, tool
calls and end-of-turn token, as the template renders the turn when it is the last one
(E_i = render(messages[:i+1])). Usually E_i starts with P_i and G_i is the rest. Some
templates render earlier turns differently once turn i follows (GPT-OSS drops a tool
call's analysis once a final reply exists, Kimi-K2-Thinking earlier reasoning): then G_i
is what follows the generation prompt in E_i, where turn i's own text starts (found by
rendering the turn with its text replaced by a mark). The turn's serving text is
S_i = P_i + G_i, and G_i's characters are the trained ones. A template whose generation
prompt does not appear before its rendered reply (DeepSeek-R1's prompt ends with
``<think>\n``, its replies have none) cannot show what the model writes: refused, naming
the turn.

One sample holds every turn whose S_i is a prefix of its text (the whole conversation's
render when it can). Templates that render an earlier turn differently once a later
question follows (Qwen3 drops the reasoning of replies before the last user question,
GPT-OSS the analysis of earlier replies) break that: by default the conversation is
refused naming the turn; with ``split_turns`` it is cut into as few samples as needed,
each the serving text of its last turn, e.g. a Qwen3 conversation of two questions becomes
two samples, while a chain of tool calls after one question stays one.

``train_reasoning=False`` / ``train_tool_calls=False`` leave the reasoning / the tool
calls of each turn untrained: their characters are where the turn's render with and
without them differ. The same comparison counts turns whose reasoning or tool calls the
template does not render at all (Llama 3.1 renders no reasoning; the embedded tiny
template renders neither), which ``prepare`` reports.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from eagle3x.data.conversations import DataError

#: The keys a reasoning trace is given under to the template (Qwen3, Kimi and DeepSeek
#: read reasoning_content, vLLM also passes reasoning, GPT-OSS reads thinking).
REASONING_ALIASES = ("reasoning_content", "reasoning", "thinking")


@dataclass(frozen=True)
class ChatSettings:
    """How conversations become samples (data.* settings, plain)."""

    max_seq_len: int
    template_kwargs: Dict[str, Any] = field(default_factory=dict)
    split_turns: bool = False
    train_reasoning: bool = True
    train_tool_calls: bool = True


def settings_of(source: Any) -> ChatSettings:
    """The ChatSettings of a plan's source (eagle3x.plan.Source)."""
    return ChatSettings(source.max_seq_len, dict(source.template_kwargs), source.split_turns,
                        source.train_reasoning, source.train_tool_calls)


@dataclass
class Piece:
    """One sample's text and its trained character spans (per assistant turn)."""

    text: str
    spans: List[Tuple[int, int]]
    #: character spans inside `spans` left untrained (reasoning / tool calls, if asked)
    excluded: List[Tuple[int, int]]
    turns: List[int]


#: Counts ``layout`` adds to (per conversation, summed by prepare).
STAT_KEYS = ("assistant_turns", "reasoning_turns", "reasoning_not_rendered", "tool_call_turns",
             "tool_calls_not_rendered", "tool_results", "split_conversations")


def template_messages(messages: Sequence[dict], string_arguments: bool = False) -> List[dict]:
    """Messages as the chat template receives them (copies): reasoning under every key
    templates read it from; tool-call arguments as json strings when `string_arguments`."""
    out = []
    for m in messages:
        m = dict(m)
        r = m.get("reasoning_content")
        if r is not None:
            for key in REASONING_ALIASES:
                m[key] = r
        if string_arguments and m.get("tool_calls"):
            calls = copy.deepcopy(m["tool_calls"])
            for c in calls:
                c["function"]["arguments"] = json.dumps(c["function"]["arguments"],
                                                        ensure_ascii=False)
            m["tool_calls"] = calls
        out.append(m)
    return out


def render(tokenizer: Any, messages: Sequence[dict], generation_prompt: bool,
           template_kwargs: Optional[Dict[str, Any]] = None,
           tools: Optional[List[dict]] = None, string_arguments: bool = False) -> str:
    """The chat template's text for `messages` (data.chat_template_kwargs passed through)."""
    kwargs = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(template_messages(messages, string_arguments),
                                         tokenize=False, add_generation_prompt=generation_prompt,
                                         **kwargs)


class _Renderer:
    """Renders prefixes of one conversation, each once, naming the turn a template fails on."""

    def __init__(self, tokenizer: Any, messages: List[dict], tools: Optional[List[dict]],
                 where: str, kwargs: Dict[str, Any]):
        self.tok, self.messages, self.tools, self.where, self.kwargs = (
            tokenizer, messages, tools, where, kwargs)
        self.cache: Dict[Tuple[int, bool], str] = {}
        self.string_arguments = _STRING_ARGUMENTS.get(id(tokenizer), False)

    def _apply(self, msgs: Sequence[dict], gen: bool) -> str:
        return render(self.tok, msgs, gen, self.kwargs, self.tools, self.string_arguments)

    def __call__(self, n: int, gen: bool) -> str:
        """The render of messages[:n] (with the generation prompt when `gen`)."""
        key = (n, gen)
        if key not in self.cache:
            try:
                self.cache[key] = self._apply(self.messages[:n], gen)
            except Exception as exc:
                if not self.string_arguments and any(m.get("tool_calls") for m in self.messages[:n]):
                    # DeepSeek's templates concatenate arguments as strings: try that shape
                    self.string_arguments = True
                    try:
                        self.cache.clear()
                        self.cache[key] = self._apply(self.messages[:n], gen)
                        _STRING_ARGUMENTS[id(self.tok)] = True
                        return self.cache[key]
                    except Exception:
                        self.string_arguments = False
                raise self._failure(n, exc) from None
        return self.cache[key]

    def variant(self, i: int, drop: Optional[str]) -> Optional[str]:
        """messages[:i+1] rendered with key `drop` removed from turn i, or (`drop` None)
        with its text fields replaced by a mark (None: the template fails on it)."""
        if drop is None:
            last = dict(self.messages[i], content=_MARK)
            if last.get("reasoning_content"):
                last["reasoning_content"] = _MARK
        else:
            last = {k: v for k, v in self.messages[i].items() if k != drop}
        try:
            return self._apply(self.messages[:i] + [last], False)
        except Exception:
            return None

    def _failure(self, n: int, exc: Exception) -> DataError:
        for k in range(1, n + 1):  # the first turn the template cannot render
            try:
                self._apply(self.messages[:k], False)
            except Exception:
                m = self.messages[k - 1]
                return DataError(f"{self.where}: turn {k - 1} ({m['role']}): the chat template "
                                 f"fails on it: {type(exc).__name__}: {exc}")
        return DataError(f"{self.where}: the chat template fails on this conversation: "
                         f"{type(exc).__name__}: {exc}")


#: Tokenizers (by id) whose template takes tool-call arguments only as json strings.
_STRING_ARGUMENTS: Dict[int, bool] = {}


def _snippet(text: str, at: int, width: int = 40) -> str:
    return repr(text[max(0, at - 12):at + width])


def _diverge(a: str, b: str) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


def _region(a: str, b: Optional[str], lo: int, hi: int) -> Optional[Tuple[int, int]]:
    """The characters of `a` (within [lo, hi)) that differ from `b`; None when equal."""
    if b is None:
        return lo, hi
    if a == b:
        return None
    shortest = min(len(a), len(b))
    q = 0
    while q < shortest and a[-1 - q] == b[-1 - q]:
        q += 1
    # where the common prefix and suffix overlap, the suffix keeps the shared characters
    # (the "<" of "<tool_call>" vs "<|im_end|>" goes with what follows, not what precedes)
    p = min(_diverge(a, b), shortest - q)
    start, end = max(p, lo), min(len(a) - q, hi)
    return (start, end) if end > start else None


#: Stand-ins for a turn's text fields, to find where the turn starts in a render.
_MARK = "\x01\x02"


@dataclass
class _Turn:
    """Assistant turn i as serving renders it: S = P + G (P the prompt, G the reply),
    G being E[split:] of E, the template's render with the turn last."""

    text: str
    lo: int
    hi: int
    #: E (the render with this turn last) and where its reply starts there
    end: str
    split: int


def _serving(r: "_Renderer", i: int, where: str) -> _Turn:
    """Turn i's serving text: the generation prompt P_i and the reply the template renders
    after it (see the module docstring)."""
    prompt, end = r(i, True), r(i + 1, False)
    if end.startswith(prompt):
        return _Turn(end, len(prompt), len(end), end, len(prompt))
    # Earlier turns render differently once this one follows (GPT-OSS drops the analysis
    # of tool calls answered by a final reply, Kimi the reasoning of earlier turns): the
    # reply is what follows the generation prompt in E, where turn i's own text starts.
    before = r(i, False)
    gen = prompt[len(before):] if prompt.startswith(before) else None
    marked = r.variant(i, None)
    first = _diverge(end, marked) if marked is not None else len(end)
    k = -1 if gen is None else (end.rfind(gen, 0, first) if gen else first)
    if k < 0:
        d = _diverge(prompt, end)
        raise DataError(
            f"{where}: turn {i} (assistant): the chat template's generation prompt "
            f"ends with {_snippet(prompt, d)}, but it renders the reply as "
            f"{_snippet(end, d)}: what the model generates after that prompt is not what "
            "the template renders, so the reply's tokens cannot be located (DeepSeek-R1 "
            "style templates open <think> in the prompt and render replies without it). "
            "A template mode whose replies follow its prompt trains "
            "(data.chat_template_kwargs, e.g. {thinking: false} for DeepSeek-V3.1)")
    split = k + len(gen)
    text = prompt + end[split:]
    return _Turn(text, len(prompt), len(text), end, split)


def layout(tokenizer: Any, messages: List[dict], tools: Optional[List[dict]], where: str,
           settings: ChatSettings, stats: Optional[Dict[str, int]] = None) -> List[Piece]:
    """The samples of one conversation: texts and the trained spans of its assistant turns."""
    r = _Renderer(tokenizer, messages, tools, where, settings.template_kwargs)
    n = len(messages)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    st = stats if stats is not None else {}
    st["assistant_turns"] = st.get("assistant_turns", 0) + len(assistant)
    st["tool_results"] = st.get("tool_results", 0) + sum(m["role"] == "tool" for m in messages)
    turns = {i: _serving(r, i, where) for i in assistant}

    pieces: List[Piece] = []
    pending = list(assistant)
    while pending:
        last = turns[pending[-1]].text
        full = r(n, False) if pending[-1] == assistant[-1] else None
        text = full if full is not None and full.startswith(last) else last
        covered = [i for i in pending if text.startswith(turns[i].text)]
        if len(covered) < len(pending) and not settings.split_turns:
            i = next(i for i in pending if i not in covered)
            own, k = turns[i].text, _diverge(turns[i].text, text)
            raise DataError(
                f"{where}: turn {i} (assistant): the chat template renders this turn "
                f"differently once later turns follow (as serving renders it {_snippet(own, k)}, "
                f"inside the conversation {_snippet(text, k)}), so one sample cannot hold it "
                "as serving renders it. Templates that drop earlier turns' reasoning (Qwen3, "
                "Kimi-K2-Thinking, GPT-OSS) do this; data.split_turns=true trains each such "
                "turn in a sample that ends with it, rendered as serving renders it")
        pieces.append(Piece(text, [(turns[i].lo, turns[i].hi) for i in covered], [], covered))
        pending = [i for i in pending if i not in covered]
    if len(pieces) > 1:
        st["split_conversations"] = st.get("split_conversations", 0) + 1
    pieces.reverse()  # in conversation order

    for piece in pieces:
        for i in piece.turns:
            m, t = messages[i], turns[i]
            shift = t.lo - t.split  # E coordinates -> the sample's
            for key, flag, count in (("reasoning_content", settings.train_reasoning, "reasoning"),
                                     ("tool_calls", settings.train_tool_calls, "tool_calls")):
                if not m.get(key) or (key == "reasoning_content" and not m[key].strip()):
                    continue
                turns_key = "reasoning_turns" if count == "reasoning" else "tool_call_turns"
                st[turns_key] = st.get(turns_key, 0) + 1
                region = _region(t.end, r.variant(i, key), t.split, len(t.end))
                if region is None:
                    missing = f"{count}_not_rendered"
                    st[missing] = st.get(missing, 0) + 1
                elif not flag:
                    piece.excluded.append((region[0] + shift, region[1] + shift))
    return pieces


def _encode(tokenizer: Any, text: str) -> Tuple[List[int], Any]:
    """Token ids and [start, end) character offsets of `text` (no special tokens added):
    straight from the Rust tokenizer when there is one (what transformers calls too)."""
    import numpy as np

    rust = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if rust is not None:
        enc = rust.encode(text, add_special_tokens=False)
        return enc.ids, np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)


def tokenize(tokenizer: Any, piece: Piece, max_seq_len: int) -> Tuple[List[int], List[int], bool]:
    """Token ids, loss mask (1: the token starts inside a trained span and overlaps no
    excluded one) and whether the sample was truncated to `max_seq_len`."""
    import numpy as np

    ids, offsets = _encode(tokenizer, piece.text)
    start, end = offsets[:, 0], offsets[:, 1]
    spans = np.asarray(sorted(piece.spans), dtype=np.int64).reshape(-1, 2)
    k = np.searchsorted(spans[:, 0], start, side="right") - 1  # the last span starting <= start
    inside = (k >= 0) & (start < spans[np.maximum(k, 0), 1]) & (end > start)
    if piece.excluded:
        # excluded: overlaps a region at all (a region found by comparing renders may begin
        # inside a token, as the "<" of "<tool_call>")
        ex = np.asarray(sorted(piece.excluded), dtype=np.int64).reshape(-1, 2)
        k = np.searchsorted(ex[:, 0], end, side="left") - 1  # the last region starting < end
        inside &= ~((k >= 0) & (ex[np.maximum(k, 0), 1] > start))
    mask = inside.astype(np.uint8).tolist()
    truncated = len(ids) > max_seq_len
    return list(ids[:max_seq_len]), mask[:max_seq_len], truncated


def assistant_spans(tokenizer: Any, messages: Sequence[dict], where: str,
                    template_kwargs: Optional[Dict[str, Any]] = None
                    ) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered text and the [start, end) character spans of assistant replies of a
    conversation that fits one sample (DataError naming the turn otherwise)."""
    pieces = layout(tokenizer, list(messages), None, where,
                    ChatSettings(0, dict(template_kwargs or {})))
    return pieces[0].text, pieces[0].spans


def encode(tokenizer: Any, messages: Sequence[dict], max_seq_len: int, where: str,
           template_kwargs: Optional[Dict[str, Any]] = None) -> Tuple[List[int], List[int], bool]:
    """Token ids, loss mask (1 = assistant token) and whether the sample was truncated, for
    a conversation that fits one sample."""
    pieces = layout(tokenizer, list(messages), None, where,
                    ChatSettings(max_seq_len, dict(template_kwargs or {})))
    return tokenize(tokenizer, pieces[0], max_seq_len)


def encode_conversation(tokenizer: Any, messages: List[dict], tools: Optional[List[dict]],
                        where: str, settings: ChatSettings,
                        stats: Optional[Dict[str, int]] = None
                        ) -> List[Tuple[List[int], List[int], bool]]:
    """Every sample of one conversation: (ids, mask, truncated) each."""
    return [tokenize(tokenizer, p, settings.max_seq_len)
            for p in layout(tokenizer, messages, tools, where, settings, stats)]
