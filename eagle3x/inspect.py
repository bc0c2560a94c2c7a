"""Show prepared samples as the draft sees them: token boundaries and the trained tokens.

    python -m eagle3x.inspect [overrides ...] [--samples 3] [--first 0] [--line N] [--plain]

The overrides are a run's (they pick the verifier, data, chat_template_kwargs,
split_turns, train_reasoning, train_tool_calls and so the prepared data; prepare runs
first if it is missing). First a summary of what the chat template made of the
conversations (assistant turns with reasoning or tool calls, tool results, turns whose
reasoning or tool calls the template does not render, conversations cut into several
samples); then each token as its text: trained tokens (loss mask 1) highlighted in colour
on a terminal, wrapped in ``[[...]]`` when the output is piped or with --plain; token
boundaries show as ``|``. Per sample: tokens, trained tokens, and the source line of the
conversation. ``--line N`` shows the samples of the conversation on line (row) N.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, List, Optional, Sequence, Tuple


def pieces(tokenizer: Any, ids: Sequence[int]) -> List[str]:
    """Each token's text as it appears in the decoded sequence (offsets of the whole)."""
    return [tokenizer.decode([int(t)], skip_special_tokens=False) for t in ids]


def elide(texts: Sequence[str], mask: Sequence[int], context: Optional[int]
          ) -> Tuple[List[str], List[int]]:
    """Untrained stretches longer than 2·context tokens shortened to their `context` first
    and last tokens around a ``…N tokens…`` marker (mask -1); None keeps everything."""
    if context is None:
        return list(texts), list(mask)
    out_t: List[str] = []
    out_m: List[int] = []
    i, n = 0, len(texts)
    while i < n:
        if mask[i]:
            out_t.append(texts[i])
            out_m.append(1)
            i += 1
            continue
        j = i
        while j < n and not mask[j]:
            j += 1
        keep_head = context if i > 0 else 0  # before the first trained token: tail only
        keep_tail = context if j < n else 0  # after the last: head only
        if j - i > keep_head + keep_tail + 1:
            out_t += texts[i:i + keep_head] + [f"…{j - i - keep_head - keep_tail} tokens…"]
            out_t += texts[j - keep_tail:j]
            out_m += [0] * keep_head + [-1] + [0] * keep_tail
        else:
            out_t += texts[i:j]
            out_m += [0] * (j - i)
        i = j
    return out_t, out_m


def render_plain(texts: Sequence[str], mask: Sequence[int]) -> str:
    """Tokens joined by `|`, runs of trained tokens wrapped in [[ ]]."""
    out, inside = [], False
    for text, m in zip(texts, mask):
        if m == -1:  # an elision marker
            out.append(text + "|")
            continue
        if m and not inside:
            out.append("[[")
        if not m and inside:
            out.append("]]")
        inside = bool(m)
        out.append(text.replace("\n", "\\n") + "|")
    if inside:
        out.append("]]")
    return "".join(out)


def summary(manifest: dict, label: str) -> str:
    """What prepare made of the conversations, from the prepared data's manifest."""
    st = manifest.get("stats", {})
    t = st.get("turns") or {}
    out = (f"{st.get('samples')} samples from {st.get('input_conversations')} conversations of "
           f"{label}: {st.get('tokens')} tokens, {st.get('loss_tokens')} trained")
    if t:
        out += (f"; {t['assistant_turns']} assistant turns, {t['reasoning_turns']} with "
                f"reasoning, {t['tool_call_turns']} with tool calls; {t['tool_results']} tool "
                "results (not trained)")
        notes = []
        if t.get("split_conversations"):
            notes.append(f"{t['split_conversations']} conversations cut into several samples "
                         "(data.split_turns)")
        for key, what in (("reasoning_not_rendered", "reasoning"),
                          ("tool_calls_not_rendered", "tool calls")):
            if t.get(key):
                notes.append(f"the chat template does not render the {what} of {t[key]} turns")
        if notes:
            out += "; " + "; ".join(notes)
    settings = manifest.get("settings", {})
    off = [k for k in ("train_reasoning", "train_tool_calls") if settings.get(k) is False]
    if off:
        out += "; untrained: " + ", ".join(k.replace("train_", "").replace("_", " ") for k in off)
    return out + "\n\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle3x.inspect",
                                description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--line", type=int, default=None,
                   help="the samples of the conversation on this line (row) of the data")
    p.add_argument("--context", type=int, default=None,
                   help="show only this many untrained tokens around each trained run")
    p.add_argument("--plain", action="store_true", help="markers instead of colour")
    args, overrides = p.parse_known_args(argv)

    from eagle3x.__main__ import validate
    from eagle3x.config.problems import EXIT_REFUSED, format_report

    argv_cfg = ["stage=prepare", *overrides]
    # only prepare runs: what later stages would need is not asked
    problems = [x for x in validate(argv_cfg)
                if x.key not in ("extract.prepared_data", "vocab.draft_vocab_size")]
    if problems:
        sys.stderr.write(format_report(problems))
        return EXIT_REFUSED
    from eagle3x.artifacts import complete_manifest
    from eagle3x.config.compose import load_config, typed
    from eagle3x.data import prepared
    from eagle3x.pipeline import run_stages, stages_for, start
    from eagle3x.verifier import load_tokenizer

    from eagle3x.artifacts import ArtifactError
    from eagle3x.data.conversations import DataError

    settings = typed(load_config(argv_cfg))
    try:
        plan = start(settings)
        if complete_manifest(plan.prepared.folder) is None:  # regenerate (if asked), prepare
            run_stages(plan, settings, stages_for(settings.stage, settings))
        data = prepared.load(plan.prepared.folder)
    except (DataError, ArtifactError) as exc:
        sys.stderr.write(f"eagle3x: {exc}\n")
        return 1
    tok = load_tokenizer(plan.verifier.path, plan.verifier.trust_remote_code)
    plain = args.plain or not sys.stdout.isatty()
    off, ids, mask, lines = data["offsets"], data["input_ids"], data["loss_mask"], data["source_line"]
    sys.stdout.write(summary(data["manifest"], plan.source.name or plan.source.path.name))
    if args.line is not None:
        chosen = [int(i) for i in (lines[: data["n"]] == args.line).nonzero()[0]]
        if not chosen:
            sys.stderr.write(f"no prepared sample comes from line {args.line} of "
                             f"{plan.source.label}\n")
            return 1
    else:
        chosen = list(range(args.first, min(args.first + args.samples, data["n"])))
    for i in chosen:
        s_ids, s_mask = ids[off[i]:off[i + 1]].tolist(), mask[off[i]:off[i + 1]].tolist()
        texts, shown = elide(pieces(tok, s_ids), s_mask, args.context)
        name = plan.source.name or plan.source.path.name
        head = (f"sample {i} (line {int(lines[i])} of {name}): "
                f"{len(s_ids)} tokens, {sum(s_mask)} trained")
        if plain:
            sys.stdout.write(f"{head}\n{render_plain(texts, shown)}\n\n")
        else:
            from rich.console import Console
            from rich.text import Text

            t = Text()
            for text, m in zip(texts, shown):
                t.append(text, style="italic" if m == -1 else
                         "bold black on green" if m else "dim")
                t.append("|", style="grey50")
            Console().print(f"[bold]{head}[/bold]")
            Console().print(t)
            Console().print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
