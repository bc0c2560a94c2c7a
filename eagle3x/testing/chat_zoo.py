"""Chat templates of the real model families, and tiny tokenizers and verifiers that use them.

``chat_templates/<name>.jinja`` are the templates as their families publish them
(sources in ``chat_templates/SOURCES.md``). ``build_tokenizer(name, folder)`` trains a
byte-level BPE tokenizer of 1024 tokens locally with `tokenizers` (nothing downloaded)
whose special tokens are the family's (atomic, with ids below 1024), sets the family's
template, and saves it as a transformers tokenizer. ``build_verifier(name, folder)`` puts
it beside a tiny zoo checkpoint of the family's architecture (eagle3x/testing/zoo.py), so
prepare, extract, train and eval run with the family's own template.

``agentic()``, ``multi_turn()`` and ``dataset()`` are conversations as users have them:
reasoning beside each reply, a tool call with empty content and its tool result, a system
prompt, a conversation's tools.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent / "chat_templates"
#: Change when a template, a token list or the corpus changes (folders are rebuilt).
CHAT_ZOO_ID = "chat-zoo-v1"
VOCAB = 1024

_DEEPSEEK = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
             "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
             "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
             "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
             "<｜▁pad▁｜>"]


@dataclass(frozen=True)
class Family:
    """A chat template and the tokens its family's tokenizer keeps whole."""

    template: str
    #: the zoo architecture its checkpoint is built as (eagle3x/testing/zoo.py)
    model: str
    special: List[str]
    bos: Optional[str]
    eos: str
    pad: str
    #: tokens kept whole but not special (decoded even with skip_special_tokens)
    plain: List[str] = field(default_factory=list)


FAMILIES: Dict[str, Family] = {
    "qwen3": Family("qwen3.jinja", "qwen3", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                    None, "<|im_end|>", "<|endoftext|>",
                    ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                     "<think>", "</think>"]),
    "llama3_1": Family("llama3_1.jinja", "llama",
                       ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
                        "<|finetune_right_pad_id|>"],
                       "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>"),
    "deepseek_v3": Family("deepseek_v3.jinja", "deepseek_v3", _DEEPSEEK,
                          "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>",
                          ["<think>", "</think>"]),
    "deepseek_r1": Family("deepseek_r1.jinja", "deepseek_v3", _DEEPSEEK,
                          "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>",
                          ["<think>", "</think>"]),
    "deepseek_v3_1": Family("deepseek_v3_1.jinja", "deepseek_v3", _DEEPSEEK,
                            "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>",
                            ["<think>", "</think>"]),
    "gpt_oss": Family("gpt_oss.jinja", "gpt_oss",
                      ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
                       "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"],
                      "<|startoftext|>", "<|return|>", "<|endoftext|>"),
    "kimi_k2": Family("kimi_k2.jinja", "deepseek_v3",
                      ["[BOS]", "[EOS]", "[PAD]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                       "<|im_system|>", "<|im_middle|>", "<|tool_calls_section_begin|>",
                       "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                       "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|media_start|>",
                       "<|media_content|>", "<|media_end|>", "<|media_pad|>"],
                      "[BOS]", "<|im_end|>", "[PAD]", ["<think>", "</think>"]),
    "chatml": Family("chatml.jinja", "qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                     None, "<|im_end|>", "<|endoftext|>"),
}


def template(name: str) -> str:
    return (HERE / FAMILIES[name].template).read_text(encoding="utf-8")


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city."}}, "required": ["city"]}}}]


def agentic(city: str = "Paris", temp: int = 21, call_id: str = "call_0") -> dict:
    """One user question answered through one tool call: system prompt, reasoning on both
    assistant turns, a tool call with empty content, its result, the answer; tools."""
    return {"tools": WEATHER, "messages": [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": call_id, "type": "function", "function": {
             "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
        {"role": "tool", "tool_call_id": call_id, "name": "get_weather",
         "content": json.dumps({"temp": temp})},
        {"role": "assistant", "reasoning_content": "It is warm.",
         "content": f"{temp} degrees in {city}."}]}


def multi_turn(k: int = 1) -> dict:
    """Two questions, each answered with reasoning."""
    return {"messages": [
        {"role": "user", "content": f"Q{k}"},
        {"role": "assistant", "reasoning_content": f"R{k}", "content": f"A{k}"},
        {"role": "user", "content": f"Q{k + 1}"},
        {"role": "assistant", "reasoning_content": f"R{k + 1}", "content": f"A{k + 1}"}]}


CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Perth", "Dakar", "Riga"]


def dataset(n: int = 40) -> List[dict]:
    """n conversations mixing tool calls, multi-turn reasoning and plain replies."""
    out = []
    for i in range(n):
        city = CITIES[i % len(CITIES)]
        kind = i % 3
        if kind == 0:
            out.append(agentic(city, 10 + i % 20, f"call_{i}"))
        elif kind == 1:
            out.append(multi_turn(i))
        else:
            out.append({"messages": [
                {"role": "user", "content": f"Say hello to {city}."},
                {"role": "assistant", "reasoning_content": "Easy.",
                 "content": f"Hello, {city}! Nice to meet you."}]})
    return out


def _corpus():
    from eagle3x.resources import resource

    with open(resource("sample_conversations.jsonl"), encoding="utf-8") as f:
        for line in f:
            for m in json.loads(line)["messages"]:
                yield m["content"]
    for record in dataset(30):
        yield json.dumps(record)


def build_tokenizer(name: str, folder: str | Path) -> Path:
    """The family `name`'s tokenizer at `folder` (built unless there, marked complete)."""
    folder = Path(folder)
    marker = folder / "chat_zoo.json"
    if marker.exists() and json.loads(marker.read_text()) == {"id": CHAT_ZOO_ID, "name": name}:
        return folder
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    fam = FAMILIES[name]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(fam.plain), special_tokens=fam.special,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fam.plain])
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=fam.bos, eos_token=fam.eos,
                                   pad_token=fam.pad)
    fast.chat_template = template(name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        fast.save_pretrained(tmp)
        (tmp / "chat_zoo.json").write_text(json.dumps({"id": CHAT_ZOO_ID, "name": name}))
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def build_verifier(name: str, root: str | Path) -> Path:
    """A tiny verifier of the family's architecture with the family's tokenizer and
    template, under `root` (built once)."""
    from eagle3x.testing import zoo

    root = Path(root) / CHAT_ZOO_ID
    tok = build_tokenizer(name, root / f"tokenizer-{name}")
    return zoo.build(FAMILIES[name].model, root / f"verifier-{name}", tok)


def main(argv: Optional[List[str]] = None) -> int:
    """python -m eagle3x.testing.chat_zoo NAME FOLDER [--data FILE]: a tiny verifier with the
    family's template at FOLDER (and conversations to try it on at FILE)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m eagle3x.testing.chat_zoo", description=main.__doc__)
    p.add_argument("name", choices=sorted(FAMILIES))
    p.add_argument("folder")
    p.add_argument("--data", help="write dataset() conversations (jsonl) here")
    p.add_argument("-n", type=int, default=40)
    args = p.parse_args(argv)
    folder = Path(args.folder)
    tok = build_tokenizer(args.name, folder.parent / f".{folder.name}.tokenizer")
    from eagle3x.testing import zoo

    zoo.build(FAMILIES[args.name].model, folder, tok)
    if args.data:
        with open(args.data, "w", encoding="utf-8") as f:
            for record in dataset(args.n):
                f.write(json.dumps(record) + "\n")
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
