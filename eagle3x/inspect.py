"""Show prepared samples as the draft sees them: token boundaries and the trained tokens.

    python -m eagle3x.inspect [overrides ...] [--samples 3] [--first 0] [--plain]

The overrides are a run's (they pick the verifier, data, chat_template_kwargs and so the
prepared data; prepare runs first if it is missing). Each token is shown as its text;
trained tokens (loss mask 1) are highlighted in colour on a terminal, and wrapped in
``[[...]]`` when the output is piped or with --plain; token boundaries show as ``|``.
Per sample: tokens, trained tokens, and the source line of the conversation.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, List, Sequence


def pieces(tokenizer: Any, ids: Sequence[int]) -> List[str]:
    """Each token's text as it appears in the decoded sequence (offsets of the whole)."""
    return [tokenizer.decode([int(t)], skip_special_tokens=False) for t in ids]


def render_plain(texts: Sequence[str], mask: Sequence[int]) -> str:
    """Tokens joined by `|`, runs of trained tokens wrapped in [[ ]]."""
    out, inside = [], False
    for text, m in zip(texts, mask):
        if m and not inside:
            out.append("[[")
        if not m and inside:
            out.append("]]")
        inside = bool(m)
        out.append(text.replace("\n", "\\n") + "|")
    if inside:
        out.append("]]")
    return "".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle3x.inspect",
                                description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--plain", action="store_true", help="markers instead of colour")
    args, overrides = p.parse_known_args(argv)

    from eagle3x.__main__ import validate
    from eagle3x.config.problems import EXIT_REFUSED, format_report

    argv_cfg = ["stage=prepare", *overrides]
    problems = [x for x in validate(argv_cfg) if x.key != "extract.prepared_data"]
    if problems:
        sys.stderr.write(format_report(problems))
        return EXIT_REFUSED
    from eagle3x.artifacts import complete_manifest
    from eagle3x.config.compose import load_config, typed
    from eagle3x.data import prepared
    from eagle3x.pipeline import run_stages, stages_for, start
    from eagle3x.verifier import load_tokenizer

    settings = typed(load_config(argv_cfg))
    plan = start(settings)
    if complete_manifest(plan.prepared.folder) is None:  # regenerate (if asked) and prepare
        run_stages(plan, settings, stages_for(settings.stage, settings))
    data = prepared.load(plan.prepared.folder)
    tok = load_tokenizer(plan.verifier.path, plan.verifier.trust_remote_code)
    plain = args.plain or not sys.stdout.isatty()
    off, ids, mask, lines = data["offsets"], data["input_ids"], data["loss_mask"], data["source_line"]
    for i in range(args.first, min(args.first + args.samples, data["n"])):
        s_ids, s_mask = ids[off[i]:off[i + 1]].tolist(), mask[off[i]:off[i + 1]].tolist()
        texts = pieces(tok, s_ids)
        head = (f"sample {i} (line {int(lines[i])} of {plan.source.path.name}): "
                f"{len(s_ids)} tokens, {sum(s_mask)} trained")
        if plain:
            sys.stdout.write(f"{head}\n{render_plain(texts, s_mask)}\n\n")
        else:
            from rich.console import Console
            from rich.text import Text

            t = Text()
            for text, m in zip(texts, s_mask):
                t.append(text, style="bold black on green" if m else "dim")
                t.append("|", style="grey50")
            Console().print(f"[bold]{head}[/bold]")
            Console().print(t)
            Console().print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
