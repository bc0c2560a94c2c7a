"""A code prompt set built on this machine: one request per documented function of Python's
standard library, for bench/quality.py's second prompt distribution (issue 36).

    python bench/code_prompts.py --out /work/data/stdlib_code.jsonl        # 320 conversations
    python bench/quality.py --data code=/work/data/stdlib_code.jsonl@regenerated ...

Why: the bundled conversations are short chat and arithmetic; a recipe chosen on them alone
may not hold on other traffic, and nothing can be downloaded here. The standard library is
on every machine and its docstrings are real prose written by many people: each prompt asks
for one function, named and shaped as the library's (its signature where `inspect` can read
one), doing what the docstring's first paragraph says, in one of a few phrasings. The
verifier's own replies to them (`@regenerated`) are code and prose about code, a domain the
default recipe was not tuned on.

Each line is `{"id", "source", "messages": [user, assistant]}`. The assistant turn is a
placeholder (the signature as a stub): eagle3x refuses a conversation without an assistant
turn, and `data.responses=regenerated` replaces it with the verifier's reply. The set is
meant for `@regenerated` only: trained as written, it would teach stubs.

Deterministic for one Python version (the modules, their docstrings and signatures are
that version's): functions sorted by qualified name, shuffled with --seed, the first --count
kept. Prints the count, the modules used and a digest of the file, so two machines can tell
whether they built the same set.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import random
import re
import sys
from pathlib import Path
from typing import Iterator, List, Tuple

#: Pure-Python modules with documented public functions (no OS-specific ones: the set must be
#: the same on every machine of one Python version).
MODULES = ("base64", "bisect", "calendar", "colorsys", "copy", "csv", "dataclasses", "datetime",
           "difflib", "email.utils", "fnmatch", "fractions", "functools", "glob", "gzip",
           "heapq", "html", "inspect", "ipaddress", "itertools", "json", "keyword", "locale",
           "math", "mimetypes", "operator", "os.path", "pathlib", "pprint", "quopri", "random",
           "re", "shlex", "shutil", "statistics", "string", "tarfile", "textwrap", "tokenize",
           "typing", "unicodedata", "urllib.parse", "uuid", "warnings", "zipfile", "zlib")

PHRASINGS = (
    "Write a Python function `{sig}` that does the following: {doc}",
    "Implement `{sig}` in Python. What it should do: {doc}",
    "I need a Python function `{sig}`. {doc} Please write it and explain briefly how it works.",
    "Can you write `{sig}` in plain Python, without importing `{module}`? {doc}",
)


def stub(name: str) -> str:
    """The placeholder assistant turn of the function `name`."""
    return f"```python\ndef {name}(...):\n    ...\n```"


def is_placeholder(reply: str) -> bool:
    """Whether an assistant turn is this set's placeholder (bench/quality.py refuses to
    train on such replies: `@regenerated` is the way)."""
    return re.fullmatch(r"```python\ndef \w+\(\.\.\.\):\n    \.\.\.\n```", reply) is not None


def first_paragraph(doc: str) -> str:
    """The docstring's first paragraph as one line of prose ('' when it is a signature line
    or too short to ask for anything)."""
    para = inspect.cleandoc(doc).split("\n\n")[0]
    text = re.sub(r"\s+", " ", para).strip()
    if "(" in text.split(" ")[0] or len(text.split()) < 6 or ">>>" in text:
        return ""
    return text if text.endswith(".") else text + "."


def functions() -> Iterator[Tuple[str, str, str, str]]:
    """(module, qualified name, signature, first paragraph) of every public documented
    function of MODULES."""
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not callable(obj) or inspect.isclass(obj):
                continue
            home = getattr(obj, "__module__", None)
            if home != module_name and home in MODULES:
                continue  # re-exported from another module of the list: asked there
            doc = first_paragraph(getattr(obj, "__doc__", None) or "")
            if not doc:
                continue
            try:
                # a default that is an object prints its address: not the same twice
                sig = re.sub(r" at 0x[0-9a-fA-F]+", "", f"{name}{inspect.signature(obj)}")
            except (TypeError, ValueError):
                sig = f"{name}(...)"
            if len(sig) > 100:
                continue
            yield module_name, f"{module_name}.{name}", sig, doc


def build(count: int, seed: int) -> List[dict]:
    seen, found = set(), []
    for f in sorted(functions(), key=lambda f: f[1]):
        if (f[2], f[3]) not in seen:  # one function reached by two names
            seen.add((f[2], f[3]))
            found.append(f)
    random.Random(seed).shuffle(found)
    rows = []
    for i, (module, qualname, sig, doc) in enumerate(found[:count]):
        phrasing = PHRASINGS[i % len(PHRASINGS)]
        prompt = phrasing.format(sig=sig, doc=doc, module=module)
        rows.append({"id": f"stdlib-{i:04d}", "source": qualname,
                     "messages": [{"role": "user", "content": prompt},
                                  {"role": "assistant", "content": stub(sig.split("(")[0])}]})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--count", type=int, default=320)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rows = build(args.count, args.seed)
    if len(rows) < args.count:
        print(f"only {len(rows)} documented functions found (asked for {args.count})",
              file=sys.stderr)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(args.out)
    modules = sorted({r["source"].rsplit(".", 1)[0] for r in rows})
    print(f"{len(rows)} prompts from {len(modules)} modules (Python {sys.version.split()[0]}) "
          f"-> {args.out}, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
