"""Regenerated replies: the verifier writes the assistant turns anew, chunk by chunk.

A folder ``<paths.artifacts>/regenerated/<fingerprint>/`` holds ``chunk-NNNNN.jsonl``
(each written whole: temporary name, then rename), ``manifest.json`` (the chunks done,
updated after each) and, once every chunk is done, ``conversations.jsonl``: one
``{"messages": [...], "tools": [...], "source_line": n, "hit_length": bool}`` per kept
conversation (``tools`` when it has them), in input order. A killed run resumes at the
first chunk not in the manifest; a finished chunk is never generated again.
SIGINT/SIGTERM finish the chunk under way, then stop (``failures.Stopped``).

Each conversation keeps its system/user/tool turns and its tools; its assistant text
replies (all, or the last with ``regenerate.turns=last``) are replaced in order, each
generated from the chat template's render of the conversation so far (earlier turns
already regenerated; the conversation's tools passed) with the generation prompt.
Assistant turns that call tools are kept as written: the tool results after them answer
those calls, and a regenerated reply would call other tools with other results, which
only running the tools could give. A regenerated reply replaces the turn's text and its
reasoning (the original author's): text the verifier wrote inside ``<think>...</think>``
becomes the turn's ``reasoning_content`` (as vLLM's reasoning parsers split it), the rest
its content; formats with special-token channels (GPT-OSS harmony) are not parsed. A
reply that reaches ``regenerate.max_new_tokens`` (or the verifier's context) is marked
``hit_length`` and counted; ``regenerate.on_length=drop`` drops its conversation. A
reply that is empty drops its conversation (nothing to learn).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set

from eagle3x import artifacts, console
from eagle3x.artifacts import Outcome
from eagle3x.config.schema import OnLength, RegenerateConfig, Turns
from eagle3x.plan import REGENERATED, RunPlan

log = logging.getLogger("eagle3x")


def chunk_name(index: int) -> str:
    return f"chunk-{index:05d}.jsonl"


def _turns(messages: List[dict], which: Turns) -> List[int]:
    """The assistant text replies to regenerate (turns calling tools are kept)."""
    idx = [i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")]
    return idx[-1:] if which is Turns.last else idx


def split_reasoning(text: str) -> Dict[str, str]:
    """A generated reply as a message: text before ``</think>`` (an opening ``<think>``
    dropped) as ``reasoning_content``, the rest as ``content``."""
    if "</think>" not in text:
        return {"role": "assistant", "content": text}
    thought, _, answer = text.partition("</think>")
    thought = thought.split("<think>", 1)[-1].strip("\n")
    return {"role": "assistant", "content": answer.lstrip("\n"), "reasoning_content": thought}


def regenerate_chunk(generator: Any, tokenizer: Any, convs: List[Any], first: int,
                     settings: RegenerateConfig, template_kwargs: Dict[str, Any],
                     context: int) -> tuple:
    """The chunk's records and counts. Turn j of every conversation is generated in one
    batch, after turn j-1 of all of them (each conditions on its own regenerated past)."""
    from eagle3x.data.chat import render
    from eagle3x.engines.generate import Sampling

    sampling = Sampling(settings.temperature, settings.top_p, settings.max_new_tokens,
                        settings.seed)
    msgs = [[dict(m) for m in c.messages] for c in convs]
    todo = [_turns(m, settings.turns) for m in msgs]
    hit = [False] * len(convs)
    dead: List[Optional[str]] = [None] * len(convs)  # why a conversation is dropped
    counts = {"replies": 0, "new_tokens": 0, "hit_length": 0, "empty": 0}
    for step in range(max((len(t) for t in todo), default=0)):
        batch = [k for k, t in enumerate(todo) if step < len(t) and not dead[k]]
        prompts, limits = [], []
        for k in batch:
            text = render(tokenizer, msgs[k][:todo[k][step]], True, template_kwargs, convs[k].tools)
            prompt = tokenizer(text, add_special_tokens=False).input_ids
            prompts.append(prompt)
            limits.append(max(1, min(settings.max_new_tokens, context - len(prompt) - 1)))
        too_long = [k for k, p in zip(batch, prompts) if len(p) >= context - 1]
        for k in too_long:
            dead[k] = "too_long_prompt"
        keep = [i for i, k in enumerate(batch) if k not in too_long]
        if not keep:
            continue
        replies = generator.generate([prompts[i] for i in keep], sampling,
                                     [limits[i] for i in keep],
                                     [settings.seed + first + batch[i] for i in keep])
        for i, reply in zip(keep, replies):
            k = batch[i]
            text = tokenizer.decode(reply.token_ids, skip_special_tokens=True).strip()
            counts["replies"] += 1
            counts["new_tokens"] += len(reply.token_ids)
            if reply.hit_length:
                counts["hit_length"] += 1
                hit[k] = True
            reply_msg = split_reasoning(text)
            if not reply_msg["content"].strip() and not reply_msg.get("reasoning_content"):
                counts["empty"] += 1
                dead[k] = "empty_reply"
                continue
            msgs[k][todo[k][step]] = reply_msg
    records = []
    dropped = {"too_long_prompt": 0, "empty_reply": 0, "hit_length": 0}
    for k, conv in enumerate(convs):
        if dead[k]:
            dropped[dead[k]] += 1
            continue
        if hit[k] and settings.on_length is OnLength.drop:
            dropped["hit_length"] += 1
            continue
        records.append({"messages": msgs[k], **({"tools": conv.tools} if conv.tools else {}),
                        "source_line": conv.line, "hit_length": hit[k]})
    return records, {**counts, "dropped": dropped}


def _write_chunk(folder: Path, index: int, records: List[dict]) -> Dict[str, Any]:
    path = folder / chunk_name(index)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"index": index, **artifacts.file_entry(path)}


def regenerate(plan: RunPlan, settings: RegenerateConfig,
               open_generator: Callable[[Set[int]], Any]) -> Outcome:
    """Make sure ``plan.regenerated.folder`` holds every conversation's regenerated replies;
    `open_generator(stop_ids)` loads the engine when there is work (the verifier's stop
    tokens, read here with the tokenizer this function already loads)."""
    from filelock import FileLock

    from eagle3x.data.conversations import iter_conversations, reader
    from eagle3x.data.extraction import stop_requests
    from eagle3x.failures import Stopped, signal_exit, signal_name
    from eagle3x.engines.generate import stop_ids
    from eagle3x.verifier import load_tokenizer

    out, fp = plan.regenerated.folder, plan.regenerated.fingerprint
    if artifacts.reuse(out, fp, "regenerated replies"):
        log.info("reusing regenerated replies at %s (same data, verifier and settings)", out)
        return Outcome("regenerated", "reused", out)
    out.mkdir(parents=True, exist_ok=True)
    stack = contextlib.ExitStack()
    with FileLock(str(out) + ".lock"):
        try:
            m = artifacts.read_manifest(out)
        except artifacts.ArtifactError:
            m = artifacts.new_manifest("regenerated", plan.config, fp, chunks=[],
                                       source=plan.original.label)
        if m.get("fingerprint") != fp:
            raise artifacts.ArtifactError(f"{out}: holds regenerated replies of other data, "
                                          "verifier or settings; eagle3x will not mix them")
        convs = list(iter_conversations(reader(plan.original)))
        size = settings.chunk_size
        n_chunks = (len(convs) + size - 1) // size
        done = {c["index"] for c in m["chunks"]
                if not artifacts.check_entry(out, c, full=False)}
        m["chunks"] = [c for c in m["chunks"] if c["index"] in done]
        tok = load_tokenizer(plan.verifier.path, plan.verifier.trust_remote_code)
        context = context_length(plan)
        generator = None
        bar = console.progress(len(convs), "regenerate", "conversations",
                               initial=min(len(done) * size, len(convs)))
        t0, new_tokens = time.perf_counter(), 0
        try:
            stop = stack.enter_context(stop_requests("finishing the current chunk"))
            for c in range(n_chunks):
                if c in done:
                    continue
                if stop["signal"] is not None:
                    raise Stopped(f"stopped by {signal_name(stop['signal'])} before chunk {c}",
                                  signal_exit(stop["signal"]))
                if generator is None:
                    log.info("regenerating %d conversations in %d chunks (%d done) into %s",
                             len(convs), n_chunks, len(done), out)
                    started = time.perf_counter()
                    generator = open_generator(stop_ids(plan.verifier.path, tok))
                    phases = getattr(generator, "started", "")
                    log.info("engine ready in %.1fs%s", time.perf_counter() - started,
                             f" ({phases})" if phases else "")
                    t0 = time.perf_counter()  # tokens/s without the engine start
                part = convs[c * size:(c + 1) * size]
                records, counts = regenerate_chunk(generator, tok, part, c * size, settings,
                                                   dict(plan.original.template_kwargs), context)
                entry = _write_chunk(out, c, records)
                m["chunks"].append({**entry, "conversations": len(part), "kept": len(records),
                                    **counts})
                artifacts.write_json_atomic(out / artifacts.MANIFEST, m)
                new_tokens += counts["new_tokens"]
                bar.update(len(part))
                bar.set_postfix(tok_s=int(new_tokens / max(time.perf_counter() - t0, 1e-9)))
        finally:
            bar.close()
            if generator is not None:
                generator.close()
            stack.close()
        return _finish(out, m, len(convs), new_tokens, time.perf_counter() - t0)


def context_length(plan: RunPlan) -> int:
    """The longest sequence the verifier takes (config.json, as vLLM reads it; 4096 if unknown)."""
    from eagle3x.verifier import verifier_context

    return verifier_context(plan.verifier.info.raw) or 4096


def _finish(out: Path, m: Dict[str, Any], total: int, new_tokens: int, seconds: float) -> Outcome:
    """Join the chunks in order into conversations.jsonl and mark the folder complete."""
    chunks = sorted(m["chunks"], key=lambda c: c["index"])
    tmp = out / (REGENERATED + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for c in chunks:
            f.write((out / c["name"]).read_text(encoding="utf-8"))
    os.replace(tmp, out / REGENERATED)
    kept = sum(c["kept"] for c in chunks)
    stats = {"conversations": total, "kept": kept,
             "replies": sum(c["replies"] for c in chunks),
             "new_tokens": sum(c["new_tokens"] for c in chunks),
             "hit_length": sum(c["hit_length"] for c in chunks),
             "dropped": {k: sum(c["dropped"][k] for c in chunks)
                         for k in ("too_long_prompt", "empty_reply", "hit_length")}}
    if new_tokens:
        stats["tokens_per_second"] = round(new_tokens / max(seconds, 1e-9), 1)
    m.update(stats=stats, complete=True,
             files=[artifacts.file_entry(out / REGENERATED)])
    artifacts.write_json_atomic(out / artifacts.MANIFEST, m)
    log.info("regenerated %d replies in %d conversations (%d kept; %d hit the length limit; "
             "dropped %s)%s -> %s", stats["replies"], total, kept, stats["hit_length"],
             stats["dropped"], f", {stats['tokens_per_second']:.0f} tok/s" if new_tokens else "",
             out)
    return Outcome("regenerated", "built", out)
