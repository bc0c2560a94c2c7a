"""A refusal report: every problem found at startup, printed as one readable block."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

#: Exit status for a refused configuration (argparse uses 2 for usage errors).
EXIT_REFUSED = 2


@dataclass
class Problem:
    """One reason to refuse a run: the key, the value given, why, and a hint."""

    key: Optional[str]
    message: str
    value: Optional[str] = None
    where: Optional[str] = None
    hint: Optional[str] = None

    def render(self) -> str:
        head = self.key or "config"
        if self.value is not None:
            head = f"{head}={self.value}"
        if self.where:
            head = f"{head}   ({self.where})"
        lines = [f"  x {head}", f"    {self.message}"]
        if self.hint:
            lines += [f"    {line}" for line in self.hint.splitlines()]
        return "\n".join(lines)


class Refused(Exception):
    """Raised with the problems that stop a run before it starts."""

    def __init__(self, problems: Sequence[Problem]):
        self.problems = list(problems)
        super().__init__(format_report(self.problems))


def format_report(problems: Sequence[Problem]) -> str:
    n = len(problems)
    title = f"eagle3x: refused before start ({n} problem{'s' if n != 1 else ''}); nothing was run."
    return "\n".join([title, ""] + [p.render() + "\n" for p in problems]).rstrip() + "\n"


def closest(word: str, candidates: Iterable[str], n: int = 3, cutoff: float = 0.6) -> List[str]:
    """The candidates closest to `word` (by difflib ratio), best first."""
    return difflib.get_close_matches(word, list(candidates), n=n, cutoff=cutoff)


def did_you_mean(options: Sequence[str]) -> Optional[str]:
    if not options:
        return None
    quoted = ", ".join(f"`{o}`" for o in options)
    return f"did you mean {quoted}?"
