"""A broad chat prompt set built on this machine, for the stand-in of a published draft
(issue 33): general requests of many kinds, none of the bundled set's kinds.

    python bench/chat_prompts.py --out /work/data/chat.jsonl                # 1359 conversations
    python bench/warm_start.py --source chat=/work/data/chat.jsonl@regenerated --source-steps 1000 ...

Why: published EAGLE-3 drafts are trained on broad chat (ShareGPT, UltraChat), usually on
the verifier's own replies to it, for thousands of steps; a user then fine-tunes one on
their own traffic. Nothing can be downloaded here, so the broad set is built from
templates: 20 kinds of request (explanations for an audience, notes and quizzes on a
topic, poems, tips, beginners' mistakes, emails, pros and cons, product descriptions,
stories, comparisons, how-tos, jobs, translations, rewrites, word problems, countries,
why-questions, trip plans, recipes, names), each over its own list of topics. The bundled conversations (the target traffic of the warm-start bench)
are arithmetic, word sorting and spelling, unit and weekday questions, small Python
functions and explanations of ML terms: none of those kinds is made here, and
`bundled_overlap` checks it (a test holds it).

Each line is `{"id", "source", "messages": [user, assistant]}` with a placeholder assistant
turn: the set is meant for `@regenerated` only (the verifier's replies replace it).

Deterministic: every prompt is built, sorted, shuffled with --seed, the first --count kept
(all of them by default).
Prints the count and a digest of the file.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import random
import re
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

TOPICS = ("photosynthesis", "the water cycle", "inflation", "plate tectonics", "vaccines",
          "the French Revolution", "compound interest", "black holes", "the immune system",
          "climate change", "democracy", "supply and demand", "the printing press",
          "evolution", "gravity", "the stock market", "electric cars", "the Roman Empire",
          "recycling", "solar power", "the internet", "earthquakes", "the moon's phases",
          "bees and pollination", "the Renaissance", "credit scores", "sleep", "volcanoes",
          "the Silk Road", "antibiotics", "rainbows", "the Cold War", "taxes", "tides",
          "the human heart", "coral reefs", "the Industrial Revolution", "cryptocurrency",
          "migration of birds", "the Olympic Games", "the pyramids of Egypt", "glaciers",
          "the metric system", "jazz", "fermentation", "the Great Wall of China", "magnets",
          "the United Nations", "hurricanes", "the Moon landing", "memory and forgetting",
          "rainforests", "the postal service", "wind power", "the Middle Ages", "dinosaurs",
          "interest rates", "the speed of light", "the placebo effect", "mushrooms")
AUDIENCES = ("a five-year-old", "a high school student", "my grandmother", "a busy manager",
             "someone who has never heard of it")
THINGS = ("the ocean", "autumn leaves", "a rainy morning", "an old lighthouse", "city lights",
          "a cup of coffee", "mountains at dawn", "a lost key", "the first snow",
          "a quiet library", "a summer storm", "a paper boat", "the night sky", "a garden",
          "a long train ride", "friendship", "an empty playground", "a candle", "the desert",
          "a lighthouse keeper", "homesickness", "a busy market", "a sleeping cat")
ACTIVITIES = ("learning a new language", "running a first marathon", "saving money",
              "staying focused while working from home", "growing tomatoes",
              "public speaking", "making new friends in a new city", "taking better photos",
              "studying for exams", "cooking for a large family", "keeping a houseplant alive",
              "writing a resume", "sleeping better", "traveling on a budget",
              "starting a small business", "learning to swim as an adult",
              "reducing screen time", "preparing for a job interview", "hiking safely",
              "organizing a small apartment")
RECIPIENTS = (("my landlord", "about a broken heater"), ("a teacher", "asking for an extension"),
              ("my team", "announcing a new meeting time"),
              ("a customer", "apologizing for a late delivery"),
              ("a neighbor", "about a noisy party"), ("my manager", "asking for a day off"),
              ("a hotel", "asking to change a booking"),
              ("a friend", "inviting them to dinner"),
              ("a company", "applying for an internship"),
              ("the city council", "about a broken streetlight"))
CHOICES = ("working from home", "renting instead of buying a house", "owning a dog",
           "living in a big city", "studying abroad", "electric scooters",
           "learning online", "a four-day work week", "nuclear energy", "social media",
           "homeschooling", "buying a used car", "freelancing", "public transport",
           "a vegetarian diet", "self-driving cars", "wearing a smartwatch", "uniforms at school")
CHARACTERS = ("a young baker", "a retired sailor", "a curious robot", "a shy dragon",
              "a lonely astronaut", "a clever fox", "a street musician", "an old librarian",
              "a lost puppy", "a girl who can talk to trees", "a tired mail carrier",
              "a brave little mouse", "a grumpy wizard", "twin detectives")
EVENTS = ("finds a mysterious map", "wins a contest by accident", "has to save the village",
          "meets a stranger on a train", "discovers a hidden door",
          "learns an important lesson about patience", "gets lost in a storm",
          "receives a letter from the future", "must cross a frozen river",
          "opens a tiny shop", "forgets something very important", "finds a friend in a storm")
PAIRS = ("cats", "dogs", "tea", "coffee", "trains", "planes", "books", "movies", "summer",
         "winter", "the city", "the countryside", "email", "phone calls", "running", "cycling")
HOWTOS = ("change a flat tire", "remove a coffee stain from a shirt", "boil an egg perfectly",
          "write a thank-you note", "negotiate a higher salary", "meditate for beginners",
          "fix a leaking faucet", "plan a birthday party", "back up my phone",
          "make sourdough bread", "tie a tie", "start journaling", "clean a cast iron pan",
          "choose a good watermelon", "set up a monthly budget", "train a puppy to sit",
          "apologize to a friend", "prepare for a long flight", "build a campfire safely",
          "learn to play the guitar")
JOBS = ("nurse", "firefighter", "farmer", "software developer", "chef", "pilot",
        "kindergarten teacher", "zookeeper", "journalist", "architect", "bus driver",
        "marine biologist", "librarian", "electrician", "veterinarian")
SENTENCES = ("Where is the train station?", "I would like a cup of tea, please.",
             "The weather is beautiful today.", "Can you help me find my hotel?",
             "Thank you for your kind invitation.", "What time does the museum open?",
             "My brother lives in a small village.", "We are going to the beach tomorrow.")
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")
INFORMAL = ("hey, can u send me the report asap?", "that meeting was kinda pointless",
            "gonna be late, traffic is crazy", "we gotta fix this bug before friday",
            "thx for the help, u saved me", "no idea why the printer keeps breaking",
            "the new guy is pretty good at his job", "lemme know if the plan works for u")
COUNTRIES = ("Japan", "Brazil", "Kenya", "Canada", "Norway", "India", "Mexico", "Egypt",
             "Australia", "Italy", "Vietnam", "Peru", "Morocco", "Iceland", "Chile",
             "New Zealand", "Portugal", "Thailand")
WHYS = ("the sky blue", "the sea salty", "ice slippery", "the sun hot", "grass green",
        "yawning contagious", "bread fluffy", "the moon visible during the day",
        "thunder loud", "honey sweet", "the Earth round", "glass transparent",
        "the ocean deep blue far from shore", "a rainbow curved", "fire hot", "the desert cold at night")
CITIES = ("Paris", "Tokyo", "Rome", "New York", "Barcelona", "Istanbul", "Cape Town",
          "Kyoto", "Lisbon", "Prague", "Buenos Aires", "Sydney")
DISHES = ("vegetable soup", "banana bread", "pancakes", "guacamole", "fried rice",
          "tomato pasta", "lentil curry", "apple pie", "a Greek salad", "chili",
          "omelette", "chocolate chip cookies", "mushroom risotto", "hummus")
PRODUCTS = ("a reusable water bottle", "noise-cancelling headphones", "a folding bicycle",
            "a handmade wool scarf", "a smart thermostat", "a travel backpack",
            "a cast iron skillet", "a desk lamp", "a board game for families", "running shoes",
            "a houseplant subscription", "a solar phone charger", "a mechanical keyboard",
            "an electric kettle", "a yoga mat")
NAMED = (("coffee shop", "serves only local beans"), ("podcast", "is about gardening"),
         ("bakery", "opens at night"), ("app", "reminds people to drink water"),
         ("band", "plays folk music"), ("boat", "belongs to a fisherman"),
         ("bookstore", "sells only mysteries"), ("robot", "helps in the kitchen"))


def kinds() -> Dict[str, Iterable[Tuple[str, str]]]:
    """Each kind of request: (the source tag, the prompt) pairs."""
    r = random.Random(1234)  # the word problems' numbers, the same on every run
    problems = []
    for i in range(60):
        d, h = r.randint(60, 600), r.randint(2, 8)
        p, q = r.randint(12, 90), r.choice((10, 15, 20, 25, 30, 40))
        a, b, c = r.randint(2, 9), r.randint(1, 20), r.randint(21, 99)
        problems += [
            ("speed", f"A train travels {d} km in {h} hours. What is its average speed?"),
            ("discount", f"A jacket costs ${p} and is on sale for {q}% off. What do I pay?"),
            ("equation", f"Solve for x: {a}x + {b} = {c}. Show the steps."),
        ]
    return {
        "explain": ((f"explain:{t}", f"Explain {t} to {a}.")
                    for t, a in itertools.product(TOPICS, AUDIENCES)),
        "topic": ((f"topic:{t}", form.format(t=t)) for t, form in itertools.product(TOPICS, (
            "What are the most common misconceptions about {t}?",
            "Write a short paragraph about {t} for a school newsletter.",
            "Give me a quiz of three questions about {t}, with the answers.",
            "Summarize the main ideas of {t} in three bullet points."))),
        "poem": ((f"poem:{t}", form.format(t=t)) for t, form in itertools.product(THINGS, (
            "Write a short poem about {t}.", "Write a haiku about {t}.",
            "Describe {t} using all five senses."))),
        "tips": ((f"tips:{t}", f"Give me {n} practical tips for {t}.")
                 for t, n in itertools.product(ACTIVITIES, ("three", "five"))),
        "mistakes": ((f"mistakes:{t}", f"What mistakes do beginners make when {t}?")
                     for t in ACTIVITIES),
        "email": ((f"email:{w}", f"Write a short, {tone} email to {w} {why}.")
                  for (w, why), tone in itertools.product(RECIPIENTS, ("polite", "firm but friendly"))),
        "proscons": ((f"proscons:{c}", form.format(c=c)) for c, form in itertools.product(CHOICES, (
            "What are the pros and cons of {c}?",
            "Give me a balanced argument for and against {c}."))),
        "product": ((f"product:{t}", f"Write a short product description for {t}.")
                    for t in PRODUCTS),
        "story": ((f"story:{c}", f"Write a very short story about {c} who {e}.")
                  for c, e in itertools.product(CHARACTERS, EVENTS)),
        "compare": ((f"compare:{a}/{b}", f"Compare {a} and {b}: which would you choose, and why?")
                    for a, b in zip(PAIRS[::2], PAIRS[1::2])),
        "howto": ((f"howto:{t}", form.format(t=t)) for t, form in itertools.product(HOWTOS, (
            "How do I {t}?", "What do I need before I {t}?"))),
        "job": ((f"job:{j}", form.format(j=j)) for j, form in itertools.product(JOBS, (
            "Describe a typical working day of a {j}.",
            "What skills does a {j} need, and how does one become one?"))),
        "translate": ((f"translate:{lang}", f"Translate into {lang}: \"{s}\"")
                      for s, lang in itertools.product(SENTENCES, LANGUAGES)),
        "formal": ((f"formal:{s}", f"Rewrite this message to sound professional: \"{s}\"")
                   for s in INFORMAL),
        "problem": problems,
        "country": [p for c in COUNTRIES for p in (
            (f"country:{c}", f"Tell me three interesting facts about {c}."),
            (f"food:{c}", f"What is a traditional dish from {c}, and how is it made?"),
            (f"visit:{c}", f"When is the best time of year to visit {c}, and why?"),
            (f"geography:{c}", f"Describe the geography and climate of {c}."))],
        "why": ((f"why:{w}", f"Why is {w}?") for w in WHYS),
        "trip": ((f"trip:{c}", f"Plan a {n}-day trip to {c} for a first-time visitor.")
                 for c, n in itertools.product(CITIES, ("two", "three"))),
        "recipe": ((f"recipe:{d}", form.format(d=d)) for d, form in itertools.product(DISHES, (
            "Give me a simple recipe for {d}.", "How can I make {d} healthier?"))),
        "name": ((f"name:{t}", f"Suggest five names for a {t} that {why}.")
                 for t, why in NAMED),
    }


#: The bundled set's kinds of request (eagle3x/resources/sample_conversations.jsonl): a
#: prompt of this set matching any of them would make the stand-in the target traffic.
BUNDLED_KINDS = (r"^What is \d+ plus \d+", r"^I have \d+ \w+, buy", r"sort these words",
                 r"^Write a Python function", r"^Which is (bigger|smaller)",
                 r"^How many \w+ are in", r"^If today is \w+day", r"^Spell the word",
                 r"^Can you explain what")


def bundled_overlap(prompts: Iterable[str]) -> List[str]:
    """The prompts that are of one of the bundled set's kinds (none, for this set)."""
    return [p for p in prompts if any(re.search(k, p) for k in BUNDLED_KINDS)]


PLACEHOLDER = "(to be regenerated)"


def is_placeholder(reply: str) -> bool:
    """Whether an assistant turn is this set's placeholder (bench/quality.py refuses to
    train on such replies: `@regenerated` is the way)."""
    return reply == PLACEHOLDER


def build(count: Optional[int], seed: int) -> List[dict]:
    found = sorted({(src, prompt) for pairs in kinds().values() for src, prompt in pairs})
    random.Random(seed).shuffle(found)
    rows = []
    for i, (src, prompt) in enumerate(found[:count]):
        rows.append({"id": f"chat-{i:04d}", "source": src,
                     "messages": [{"role": "user", "content": prompt},
                                  {"role": "assistant", "content": PLACEHOLDER}]})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--count", type=int, default=None, help="default: every prompt")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rows = build(args.count, args.seed)
    if args.count is not None and len(rows) < args.count:
        print(f"only {len(rows)} prompts can be built (asked for {args.count})", file=sys.stderr)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(args.out)
    print(f"{len(rows)} prompts -> {args.out}, "
          f"sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
