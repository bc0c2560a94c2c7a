"""Chat templating with a loss mask that is 1 exactly on assistant tokens.

Works with any tokenizer whose chat template renders a conversation prefix as a prefix
of the whole (true for common templates): the assistant turn i spans the characters
between the render of messages[:i] (with the generation prompt) and the render of
messages[:i+1]; a token is an assistant token when it starts inside such a span.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

from eagle3x.data.conversations import DataError


def assistant_spans(tokenizer: Any, messages: Sequence[dict], where: str) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered text and the [start, end) character spans of assistant replies."""
    def render(msgs: Sequence[dict], gen: bool) -> str:
        return tokenizer.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=gen)

    text = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start_text = render(messages[:i], True)
        end_text = render(messages[: i + 1], False)
        if not (text.startswith(start_text) and text.startswith(end_text)):
            raise DataError(f"{where}: the chat template does not render turn {i} as a prefix "
                            "of the conversation, so assistant tokens cannot be located")
        spans.append((len(start_text), len(end_text)))
    return text, spans


def encode(tokenizer: Any, messages: Sequence[dict], max_seq_len: int, where: str) -> Tuple[List[int], List[int], bool]:
    """Token ids, loss mask (1 = assistant token) and whether the sample was truncated."""
    text, spans = assistant_spans(tokenizer, messages, where)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = []
    for start, end in offsets:
        inside = any(s <= start < e for s, e in spans) and end > start
        mask.append(1 if inside else 0)
    truncated = len(ids) > max_seq_len
    return ids[:max_seq_len], mask[:max_seq_len], truncated
