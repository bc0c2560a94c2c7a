"""Regenerated replies: the verifier writes the assistant turns anew, conversation by
conversation.

A folder ``<paths.artifacts>/regenerated/<fingerprint>/`` holds ``chunk-NNNNN.jsonl``
(`regenerate.chunk_size` conversations, each chunk written whole: temporary name, then
rename), ``manifest.json`` (the chunks done, updated after each) and, once every chunk is
done, ``conversations.jsonl``: one ``{"messages": [...], "tools": [...], "source_line": n,
"hit_length": bool}`` per kept conversation (``tools`` when it has them), in input order.

The unit of resume is the conversation: while a chunk is under way, each conversation is
appended to ``chunk-NNNNN.part.jsonl`` as it finishes (one line: its record, or why it was
dropped, and its counts; flushed to disk after each engine step). A line cut short by a
kill is ignored, so each line is there whole or not at all. A rerun takes the finished
conversations from there and regenerates only the rest; the chunk's file is then written
from both, in input order, and the part file removed. SIGINT/SIGTERM end the run within
one engine step (transformers: one decode step of the batch; vLLM: one scheduler step):
what finished is kept, the rest of the batch is abandoned, and `failures.Stopped` says
what is kept (the pipeline's last line names the command that continues).

Each conversation keeps its system/user/tool turns and its tools; its assistant text
replies (all, or the last with ``regenerate.turns=last``) are replaced in order, each
generated from the chat template's render of the conversation so far (earlier turns
already regenerated; the conversation's tools passed) with the generation prompt. A
conversation's next turn is queued as soon as its previous reply is in, so the engine
always holds the chunk's open turns (vLLM schedules them itself; transformers decodes
them `regenerate.batch_size` at a time). Assistant turns that call tools are kept as
written: the tool results after them answer those calls, and a regenerated reply would
call other tools with other results, which only running the tools could give. A
regenerated reply replaces the turn's text and its reasoning (the original author's):
text the verifier wrote inside ``<think>...</think>`` becomes the turn's
``reasoning_content`` (as vLLM's reasoning parsers split it), the rest its content;
formats with special-token channels (GPT-OSS harmony) are not parsed. A reply that reaches
``regenerate.max_new_tokens`` (or the verifier's context) is marked ``hit_length`` and
counted; ``regenerate.on_length=drop`` drops its conversation. A reply that is empty drops
its conversation (nothing to learn). Every reply of conversation n is drawn with seed
``regenerate.seed + n``, so a resumed run writes what an uninterrupted one would (greedy:
exactly; sampled: as far as the engine's batching leaves sampling unchanged).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

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


def reply_count(conv: Any, which: Turns) -> int:
    """The replies regeneration makes for one conversation (the progress display counts
    these: a multi-turn conversation finishes only after its last turn, so counted by
    conversations the early rate, and the ETA, would be far off)."""
    return len(_turns(conv.messages, which))


def split_reasoning(text: str) -> Dict[str, str]:
    """A generated reply as a message: text before ``</think>`` (an opening ``<think>``
    dropped) as ``reasoning_content``, the rest as ``content``."""
    if "</think>" not in text:
        return {"role": "assistant", "content": text}
    thought, _, answer = text.partition("</think>")
    thought = thought.split("<think>", 1)[-1].strip("\n")
    return {"role": "assistant", "content": answer.lstrip("\n"), "reasoning_content": thought}


class _Conversation:
    """One conversation under way: its messages (replies replaced as they come), the turns
    left, and its counts."""

    def __init__(self, index: int, conv: Any, which: Turns):
        self.index, self.conv = index, conv
        self.msgs = [dict(m) for m in conv.messages]
        self.turns = _turns(self.msgs, which)
        self.at, self.hit, self.dead = 0, False, None  # dead: why it is dropped
        self.counts = {"replies": 0, "new_tokens": 0, "hit_length": 0, "empty": 0}

    def request(self, tokenizer: Any, settings: RegenerateConfig,
                template_kwargs: Dict[str, Any], context: int) -> Optional[Any]:
        """The next turn's `Request`, or None when the conversation is finished."""
        from eagle3x.data.chat import render
        from eagle3x.engines.generate import Request

        if self.dead or self.at >= len(self.turns):
            return None
        text = render(tokenizer, self.msgs[:self.turns[self.at]], True, template_kwargs,
                      self.conv.tools)
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        if len(prompt) >= context - 1:
            self.dead = "too_long_prompt"
            return None
        limit = max(1, min(settings.max_new_tokens, context - len(prompt) - 1))
        return Request(self.index, prompt, limit, settings.seed + self.index)

    def take(self, reply: Any, tokenizer: Any) -> None:
        """The reply to the turn asked for last."""
        text = tokenizer.decode(reply.token_ids, skip_special_tokens=True).strip()
        self.counts["replies"] += 1
        self.counts["new_tokens"] += len(reply.token_ids)
        if reply.hit_length:
            self.counts["hit_length"] += 1
            self.hit = True
        msg = split_reasoning(text)
        if not msg["content"].strip() and not msg.get("reasoning_content"):
            self.counts["empty"] += 1
            self.dead = "empty_reply"
            return
        self.msgs[self.turns[self.at]] = msg
        self.at += 1

    def entry(self, on_length: OnLength) -> Dict[str, Any]:
        """Its line in the part file: the record (None when dropped), why dropped, counts."""
        dropped = self.dead or ("hit_length" if self.hit and on_length is OnLength.drop
                                else None)
        record = None if dropped else {
            "messages": self.msgs, **({"tools": self.conv.tools} if self.conv.tools else {}),
            "source_line": self.conv.line, "hit_length": self.hit}
        return {"index": self.index, "record": record, "dropped": dropped, **self.counts}


def regenerate_conversations(generator: Any, tokenizer: Any, convs: Sequence[Tuple[int, Any]],
                             settings: RegenerateConfig, template_kwargs: Dict[str, Any],
                             context: int, finished: Callable[[Dict[str, Any]], None],
                             on_step: Optional[Callable[[int], bool]] = None,
                             replied: Optional[Callable[[int], None]] = None) -> bool:
    """Regenerate `convs` ((index in the input, conversation) pairs), calling
    `finished(entry)` for each as it ends (`_Conversation.entry`). `on_step(tokens)` is
    the generator's (`eagle3x.engines.generate`): False stops the work within one decode
    step. `replied(n)` counts replies off `reply_count`'s total: 1 per reply made, and a
    conversation dropped early (too long, an empty reply) its turns left, so the count of
    a finished run is that total. Returns True when every conversation finished, False
    when stopped (the unfinished ones abandoned and the generator's queue emptied)."""
    from eagle3x.engines.generate import Sampling

    sampling = Sampling(settings.temperature, settings.top_p, settings.max_new_tokens,
                        settings.seed)
    open_: Dict[int, _Conversation] = {}

    def advance(c: _Conversation) -> Optional[Any]:
        r = c.request(tokenizer, settings, template_kwargs, context)
        if r is None:
            if replied is not None and len(c.turns) > c.counts["replies"]:
                replied(len(c.turns) - c.counts["replies"])  # the turns it will not reach
            finished(c.entry(settings.on_length))
        else:
            open_[c.index] = c
        return r

    first_turns = [advance(_Conversation(i, conv, settings.turns)) for i, conv in convs]
    generator.submit([r for r in first_turns if r is not None], sampling)
    stopped = False
    while generator.pending() and not stopped:
        def step_hook(tokens: int) -> bool:
            nonlocal stopped
            if on_step is not None and not on_step(tokens):
                stopped = True
            return not stopped

        nxt = []
        for key, reply in generator.step(step_hook):
            c = open_.pop(key)
            c.take(reply, tokenizer)
            if replied is not None:
                replied(1)
            r = advance(c)
            if r is not None:
                nxt.append(r)
        if nxt and not stopped:
            generator.submit(nxt, sampling)
    if stopped:
        generator.cancel()
        return False
    return True


def regenerate_chunk(generator: Any, tokenizer: Any, convs: List[Any], first: int,
                     settings: RegenerateConfig, template_kwargs: Dict[str, Any],
                     context: int) -> tuple:
    """The chunk's records (input order) and counts, all at once (no stopping)."""
    entries: List[Dict[str, Any]] = []
    regenerate_conversations(generator, tokenizer, [(first + k, c) for k, c in enumerate(convs)],
                             settings, template_kwargs, context, entries.append)
    return _records(entries), _counts(entries)


def _records(entries: List[Dict[str, Any]]) -> List[dict]:
    return [e["record"] for e in sorted(entries, key=lambda e: e["index"]) if e["record"]]


def _counts(entries: List[Dict[str, Any]]) -> Dict[str, Any]:
    counts: Dict[str, Any] = {k: sum(e[k] for e in entries)
                              for k in ("replies", "new_tokens", "hit_length", "empty")}
    counts["dropped"] = {k: sum(e["dropped"] == k for e in entries)
                         for k in ("too_long_prompt", "empty_reply", "hit_length")}
    return counts


def part_name(index: int) -> str:
    return f"chunk-{index:05d}.part.jsonl"


def read_part(folder: Path, index: int) -> Dict[int, Dict[str, Any]]:
    """The finished conversations of chunk `index` so far, by conversation index (a line
    cut short by a kill, the file's last, is ignored)."""
    path = folder / part_name(index)
    got: Dict[int, Dict[str, Any]] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return got
    for line in text.split("\n"):
        try:
            e = json.loads(line)
        except ValueError:
            continue
        got[int(e["index"])] = e
    return got


class _Part:
    """The part file of a chunk under way: lines appended, flushed to disk by `sync`."""

    def __init__(self, folder: Path, index: int, kept: int):
        self.path = folder / part_name(index)
        if kept == 0:
            self.path.unlink(missing_ok=True)
        else:  # drop a torn last line before appending after it
            text = self.path.read_text(encoding="utf-8")
            if not text.endswith("\n"):
                self.path.write_text(text[:text.rfind("\n") + 1], encoding="utf-8")
        self.f = open(self.path, "a", encoding="utf-8")
        self.dirty = False

    def add(self, entry: Dict[str, Any]) -> None:
        self.f.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self.dirty = True

    def sync(self) -> None:
        if self.dirty:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.dirty = False

    def close(self) -> None:
        self.sync()
        self.f.close()


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
        parts = {c: read_part(out, c) for c in range(n_chunks) if c not in done}
        finished = (sum(min(size, len(convs) - c * size) for c in done)
                    + sum(len(p) for p in parts.values()))
        generator = None
        replies = [reply_count(conv, settings.turns) for conv in convs]
        already = (sum(sum(replies[c * size:(c + 1) * size]) for c in done)
                   + sum(replies[i] for p in parts.values() for i in p))
        bar = console.progress(sum(replies), "regenerate", "replies", initial=already)
        shown = {"conversations": f"{finished}/{len(convs)}"}  # tqdm's set_postfix replaces
        bar.set_postfix(**shown)
        t0, new_tokens, made = time.perf_counter(), 0, 0
        try:
            stop = stack.enter_context(stop_requests(
                "stopping after the current decode step; finished conversations are kept"))

            def on_step(tokens: int) -> bool:
                nonlocal made
                made += tokens
                shown["tok_s"] = int(made / max(time.perf_counter() - t0, 1e-9))
                bar.set_postfix(**shown)
                bar.update(0)  # a line every 30 s off a terminal, finished or not
                return stop["signal"] is None

            for c in range(n_chunks):
                if c in done:
                    continue
                if stop["signal"] is not None:
                    raise Stopped(f"stopped by {signal_name(stop['signal'])} before chunk {c}",
                                  signal_exit(stop["signal"]), kept=_kept(out, m, finished))
                if generator is None:
                    log.info("regenerating %d conversations in %d chunks (%d conversations "
                             "done) into %s", len(convs), n_chunks, finished, out)
                    started = time.perf_counter()
                    generator = open_generator(stop_ids(plan.verifier.path, tok))
                    phases = getattr(generator, "started", "")
                    log.info("engine ready in %.1fs%s", time.perf_counter() - started,
                             f" ({phases})" if phases else "")
                    t0 = time.perf_counter()  # tokens/s without the engine start
                    if hasattr(bar, "rate_from_now"):  # and the ETA (tqdm's rate is recent)
                        bar.rate_from_now()
                chunk = convs[c * size:(c + 1) * size]
                have = parts[c]
                todo = [(c * size + k, conv) for k, conv in enumerate(chunk)
                        if c * size + k not in have]
                part = _Part(out, c, len(have))
                entries = list(have.values())

                def conversation_done(entry: Dict[str, Any]) -> None:
                    nonlocal finished, new_tokens
                    part.add(entry)
                    entries.append(entry)
                    finished += 1
                    new_tokens += entry["new_tokens"]
                    shown["conversations"] = f"{finished}/{len(convs)}"
                    bar.set_postfix(**shown)

                def synced(tokens: int) -> bool:
                    part.sync()  # what finished in the last step is on disk
                    return on_step(tokens)

                try:
                    complete = regenerate_conversations(
                        generator, tok, todo, settings, dict(plan.original.template_kwargs),
                        context, conversation_done, synced, bar.update)
                except Exception as e:
                    part.close()
                    if stop["signal"] is not None:  # the engine died of the same signal
                        raise Stopped(f"stopped by {signal_name(stop['signal'])} in chunk {c}",
                                      signal_exit(stop["signal"]),
                                      kept=_kept(out, m, finished)) from e
                    raise
                part.close()
                if not complete:
                    raise Stopped(f"stopped by {signal_name(stop['signal'])} in chunk {c}",
                                  signal_exit(stop["signal"]), kept=_kept(out, m, finished))
                records = _records(entries)
                entry = _write_chunk(out, c, records)
                m["chunks"].append({**entry, "conversations": len(chunk), "kept": len(records),
                                    **_counts(entries)})
                artifacts.write_json_atomic(out / artifacts.MANIFEST, m)
                (out / part_name(c)).unlink(missing_ok=True)
        finally:
            bar.close()
            if generator is not None:
                generator.close()
            stack.close()
        return _finish(out, m, len(convs), new_tokens, time.perf_counter() - t0)


def _kept(out: Path, m: Dict[str, Any], finished: int) -> str:
    """What a stopped run leaves (as `eagle3x.stopping.kept_by` says it)."""
    under_way = finished - sum(c["conversations"] for c in m["chunks"])
    return (f"{finished} conversation{'s' * (finished != 1)} regenerated "
            f"({len(m['chunks'])} whole chunk{'s' * (len(m['chunks']) != 1)}"
            f"{f', {under_way} in chunks under way' if under_way else ''}) in {out}")


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
