"""Chat templating with a loss mask that is 1 exactly on assistant tokens.

Works with any tokenizer whose chat template renders a conversation prefix as a prefix
of the whole (true for common templates): the assistant turn i spans the characters
between the render of messages[:i] (with the generation prompt) and the render of
messages[:i+1]; a token is an assistant token when it starts inside such a span.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from eagle3x.data.conversations import DataError


def render(tokenizer: Any, messages: Sequence[dict], generation_prompt: bool,
           template_kwargs: Optional[Dict[str, Any]] = None) -> str:
    """The chat template's text for `messages` (data.chat_template_kwargs passed through)."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=generation_prompt,
                                         **(template_kwargs or {}))


def assistant_spans(tokenizer: Any, messages: Sequence[dict], where: str,
                    template_kwargs: Optional[Dict[str, Any]] = None
                    ) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered text and the [start, end) character spans of assistant replies."""
    def render_(msgs: Sequence[dict], gen: bool) -> str:
        return render(tokenizer, msgs, gen, template_kwargs)

    text = render_(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start_text = render_(messages[:i], True)
        end_text = render_(messages[: i + 1], False)
        if not (text.startswith(start_text) and text.startswith(end_text)):
            raise DataError(f"{where}: the chat template does not render turn {i} as a prefix "
                            "of the conversation, so assistant tokens cannot be located")
        spans.append((len(start_text), len(end_text)))
    return text, spans


def encode(tokenizer: Any, messages: Sequence[dict], max_seq_len: int, where: str,
           template_kwargs: Optional[Dict[str, Any]] = None) -> Tuple[List[int], List[int], bool]:
    """Token ids, loss mask (1 = assistant token) and whether the sample was truncated."""
    text, spans = assistant_spans(tokenizer, messages, where, template_kwargs)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = []
    for start, end in offsets:
        inside = any(s <= start < e for s, e in spans) and end > start
        mask.append(1 if inside else 0)
    truncated = len(ids) > max_seq_len
    return ids[:max_seq_len], mask[:max_seq_len], truncated
