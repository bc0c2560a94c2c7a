"""Write eagle3x/resources/sample_conversations.jsonl: the bundled demo conversations.

Deterministic (seeded): rerunning it rewrites the same file. The conversations are
short, multi-turn and varied enough (arithmetic, conversions, lists, definitions,
small code) that a draft model has real structure to learn from a tiny verifier.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "eagle3x" / "resources" / "sample_conversations.jsonl"

GLOSSARY = {
    "a draft model": "a small model that proposes several next tokens which a larger model then checks in one pass",
    "speculative decoding": "a way to speed up generation: a cheap model guesses tokens and the big model verifies them together",
    "a hidden state": "the vector a transformer layer produces for each token",
    "a tokenizer": "the tool that turns text into the integer ids a model reads",
    "a loss mask": "a list of ones and zeros saying which tokens count towards the training loss",
    "tensor parallelism": "splitting each weight matrix of a model across several GPUs",
    "a checkpoint": "a saved copy of a model's weights and training state",
    "a learning rate": "the step size an optimizer takes when it updates the weights",
    "an epoch": "one full pass over the training data",
    "a vocabulary": "the set of tokens a model can read and write",
    "attention": "the mechanism that lets each token look at the tokens before it",
    "a batch": "a group of samples processed together in one step",
}
UNITS = [("kilometres", "metres", 1000), ("hours", "minutes", 60), ("kilograms", "grams", 1000),
         ("minutes", "seconds", 60), ("metres", "centimetres", 100), ("days", "hours", 24)]
FRUITS = ["apples", "pears", "plums", "oranges", "lemons", "cherries", "figs", "grapes"]
WORDS = ["river", "planet", "garden", "window", "yellow", "silver", "market", "button",
         "rocket", "candle", "forest", "bridge", "pencil", "dragon", "summer", "castle"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SYSTEMS = ["You are a helpful assistant.", "You are a concise assistant. Answer briefly.",
           "You are a friendly tutor who explains step by step."]
THANKS = ["Thanks!", "Great, thank you.", "Perfect, thanks a lot.", "That helps, thanks."]
WELCOME = ["You're welcome!", "Glad I could help.", "Any time. Ask if you need more.",
           "You're welcome. Happy to help again."]


def arithmetic(r: random.Random) -> list:
    a, b = r.randint(2, 99), r.randint(2, 99)
    c = r.randint(2, 9)
    return [
        ("user", f"What is {a} plus {b}?"),
        ("assistant", f"{a} plus {b} is {a + b}."),
        ("user", f"And if I multiply that by {c}?"),
        ("assistant", f"{a + b} times {c} is {(a + b) * c}."),
    ]


def word_problem(r: random.Random) -> list:
    fruit = r.choice(FRUITS)
    have, buy, eat = r.randint(3, 20), r.randint(2, 15), r.randint(1, 5)
    return [
        ("user", f"I have {have} {fruit}, buy {buy} more and eat {eat}. How many are left?"),
        ("assistant", f"You start with {have}, add {buy} to get {have + buy}, then eat {eat}. "
                      f"That leaves {have + buy - eat} {fruit}."),
    ]


def convert(r: random.Random) -> list:
    big, small, factor = r.choice(UNITS)
    n = r.randint(2, 12)
    return [
        ("user", f"How many {small} are in {n} {big}?"),
        ("assistant", f"There are {factor} {small} in one of the {big}, so {n} {big} are "
                      f"{n * factor} {small}."),
        ("user", r.choice(THANKS)),
        ("assistant", r.choice(WELCOME)),
    ]


def define(r: random.Random) -> list:
    term, meaning = r.choice(list(GLOSSARY.items()))
    other, other_meaning = r.choice(list(GLOSSARY.items()))
    turns = [("user", f"Can you explain what {term} is?"),
             ("assistant", f"Sure. {term[0].upper() + term[1:]} is {meaning}.")]
    if other != term:
        turns += [("user", f"And {other}?"),
                  ("assistant", f"{other[0].upper() + other[1:]} is {other_meaning}.")]
    return turns


def sort_words(r: random.Random) -> list:
    words = r.sample(WORDS, r.randint(3, 6))
    return [
        ("user", "Please sort these words alphabetically: " + ", ".join(words) + "."),
        ("assistant", "In alphabetical order: " + ", ".join(sorted(words)) + "."),
        ("user", "Which one is the longest?"),
        ("assistant", f"The longest word is \"{max(words, key=lambda w: (len(w), w))}\"."),
    ]


def spell(r: random.Random) -> list:
    w = r.choice(WORDS)
    return [
        ("user", f"Spell the word {w} backwards."),
        ("assistant", f"{w} backwards is {w[::-1]}."),
        ("user", "How many letters does it have?"),
        ("assistant", f"The word {w} has {len(w)} letters."),
    ]


def weekday(r: random.Random) -> list:
    d = r.randrange(7)
    k = r.randint(1, 20)
    return [
        ("user", f"If today is {DAYS[d]}, what day is it in {k} days?"),
        ("assistant", f"{k} days after {DAYS[d]} is {DAYS[(d + k) % 7]}."),
    ]


def code(r: random.Random) -> list:
    name = r.choice(["total", "add_all", "sum_list", "accumulate"])
    n = r.randint(2, 9)
    return [
        ("user", "Write a Python function that returns the sum of a list of numbers."),
        ("assistant", f"Here is one:\n\ndef {name}(numbers):\n    result = 0\n    for x in numbers:\n"
                      f"        result += x\n    return result"),
        ("user", f"What does it return for the numbers 1 to {n}?"),
        ("assistant", f"It returns {n * (n + 1) // 2}, because 1 + 2 + ... + {n} = {n * (n + 1) // 2}."),
    ]


def compare(r: random.Random) -> list:
    a, b = r.sample(range(10, 500), 2)
    return [
        ("user", f"Which is bigger, {a} or {b}?"),
        ("assistant", f"{max(a, b)} is bigger than {min(a, b)}, by {abs(a - b)}."),
    ]


KINDS = [arithmetic, word_problem, convert, define, sort_words, spell, weekday, code, compare]


def main(n: int = 320, seed: int = 0) -> None:
    r = random.Random(seed)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        for i in range(n):
            turns = KINDS[i % len(KINDS)](r)
            if r.random() < 0.5:
                turns = turns + KINDS[r.randrange(len(KINDS))](r)
            messages = [{"role": role, "content": text} for role, text in turns]
            if r.random() < 0.3:
                messages.insert(0, {"role": "system", "content": r.choice(SYSTEMS)})
            f.write(json.dumps({"id": f"sample-{i:04d}", "messages": messages}) + "\n")
    print(f"wrote {n} conversations to {OUT}")


if __name__ == "__main__":
    main()
