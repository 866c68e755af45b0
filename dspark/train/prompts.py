"""Training prompts built on this machine, never from the evaluation sets.

Three families that mirror what users ask a chat model: arithmetic word problems from
templates, coding tasks from the Python standard library's own docstrings, and general
writing/explaining tasks about words taken from the target's vocabulary.
"""
from __future__ import annotations

import importlib
import inspect
import random

NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jade", "Kofi", "Lena",
         "Mateo", "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara"]
ITEMS = ["apples", "books", "marbles", "stickers", "pencils", "cookies", "coins", "cards", "shells", "stamps"]
MATH_TEMPLATES = [
    "{a} has {x} {item}. {b} gives {a} {y} more, then {a} gives away {z}. How many {item} does {a} have now?",
    "A shop sells {item} at ${p} each. {a} buys {x} of them and pays with a ${big} bill. How much change does {a} get?",
    "{a} reads {x} pages a day. How many days does it take to finish a book of {n} pages?",
    "A train travels {x} km in {y} hours. At the same speed, how far does it go in {z} hours?",
    "{a} saves ${x} every week. After {y} weeks {a} spends ${z}. How much money is left?",
    "The price of a jacket is ${n}. It is discounted by {pct}%. What is the new price?",
    "A rectangle is {x} cm long and {y} cm wide. What are its area and its perimeter?",
    "{a} and {b} share {n} {item} in the ratio {x}:{y}. How many does each get?",
    "Solve for x: {x}x + {y} = {n}.",
    "What is the sum of all integers from 1 to {n}?",
    "If {x} workers build a wall in {y} days, how long do {z} workers take, working at the same rate?",
    "Find the greatest common divisor and least common multiple of {x} and {n}.",
]
GENERAL_TEMPLATES = [
    "Explain what '{w}' means and use it in two example sentences.",
    "Write a short poem about {w}.",
    "Write a short story (one paragraph) that involves {w}.",
    "Give me three practical tips related to {w}.",
    "What is the history of {w}? Answer briefly.",
    "Describe {w} to a ten-year-old.",
    "Write a friendly email inviting a colleague to a meeting about {w}.",
    "What are the pros and cons of {w}?",
    "Compare {w} and {w2} in a few sentences.",
    "Write a product description for something called '{w}'.",
]
CODE_TEMPLATES = [
    "Write a Python function that does the following: {doc} Include a short usage example.",
    "Explain what the Python function `{name}` does and show an example of using it.",
    "Implement your own version of `{name}` in Python without importing `{module}`. It should: {doc}",
    "Write a unit test for `{name}` from the `{module}` module.",
    "What is a common mistake when using `{name}` in Python, and how do you avoid it?",
]
STDLIB_MODULES = ["string", "itertools", "collections", "math", "re", "json", "os.path", "datetime", "functools",
                  "statistics", "textwrap", "random", "heapq", "bisect", "fractions", "shutil", "glob", "csv",
                  "operator", "difflib", "calendar", "base64", "hashlib", "zlib", "secrets", "uuid", "pathlib",
                  "urllib.parse", "html", "fnmatch", "copy", "pprint", "enum", "dataclasses", "decimal"]


def stdlib_functions() -> list[tuple[str, str, str]]:
    """(module, qualified name, first docstring sentence) for public stdlib callables."""
    out = []
    for mod_name in STDLIB_MODULES:
        mod = importlib.import_module(mod_name)
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not callable(obj) or (inspect.isclass(obj) and issubclass(obj, BaseException)):
                continue
            doc = inspect.getdoc(obj) or ""
            first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
            if 20 <= len(first) <= 300 and not first.startswith(name + "("):
                out.append((mod_name, f"{mod_name}.{name}", first))
    return out


def vocabulary_words(tokens: list[str], limit: int = 4000) -> list[str]:
    """Plain lowercase English-looking words from a byte-level BPE vocabulary ('Ġword')."""
    words = [t[1:] for t in tokens if t.startswith("Ġ") and t[1:].isalpha() and t[1:].islower() and len(t) >= 6]
    return words[:limit]


FALLBACK_WORDS = ["river", "garden", "engine", "library", "market", "planet", "bridge", "forest", "music", "harbor"]


def build_prompts(n: int, vocab_tokens: list[str], seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    # Targets whose vocabulary is not byte-level BPE (e.g. tiny test tokenizers) get fixed words.
    funcs, words = stdlib_functions(), vocabulary_words(vocab_tokens) or FALLBACK_WORDS
    prompts = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            x, y = rng.randint(2, 60), rng.randint(2, 40)
            prompts.append(rng.choice(MATH_TEMPLATES).format(
                a=rng.choice(NAMES), b=rng.choice(NAMES), item=rng.choice(ITEMS), x=x, y=y,
                z=rng.randint(1, min(x, y)), p=rng.randint(1, 9), big=rng.choice([20, 50, 100]),
                n=rng.randint(61, 500), pct=rng.choice([10, 15, 20, 25, 30, 40])))
        elif kind == 1:
            module, name, doc = rng.choice(funcs)
            prompts.append(rng.choice(CODE_TEMPLATES).format(module=module, name=name, doc=doc))
        else:
            prompts.append(rng.choice(GENERAL_TEMPLATES).format(w=rng.choice(words), w2=rng.choice(words)))
    return prompts
