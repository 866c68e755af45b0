"""Prompts from templates: chat, writing, reasoning, math word problems, code, constraints, multi-turn.

Every generator takes a random.Random and returns one record {"category", "turns"}; the slot
values come from vocab.py. Numbers are drawn so that the problems have whole-number answers.
"""
from __future__ import annotations

import random

from dspark.train.corpus.vocab import (
    AUDIENCES,
    BUGGY_SNIPPETS,
    CODE_FOLLOW_UPS,
    CODE_TASKS,
    CONSTRAINTS,
    FOLLOW_UPS,
    ITEMS,
    LANGUAGES,
    MATH_FOLLOW_UPS,
    NAMES,
    PLACES,
    TONES,
    TOPICS,
    WRITING_FORMS,
)

CHAT = [
    "What is {t}?", "Can you explain {t} in simple terms?", "Why does {t} matter?", "Tell me something surprising "
    "about {t}.", "I want to learn about {t}. Where should I start?", "What are common misconceptions about {t}?",
    "How would you explain {t} to {aud}?", "What are the pros and cons of {t}?", "Give me three fun facts about {t}.",
    "What is the difference between {t} and {t2}?", "How is {t} related to {t2}?", "What questions should I ask an "
    "expert on {t}?", "I'm planning a trip to {p}. What should I pack and see?", "What is the best way to get "
    "better at {t}?", "Is {t} overrated? Give a balanced view.", "Summarize the history of {t} in a paragraph.",
    "What careers involve {t}?", "hey, quick question: how does {t} work?", "My friend says {t} is boring. How can "
    "I convince them otherwise?", "What would the world look like without {t}?",
]
WRITING = [
    "Write {form} about {t}.", "Write {form} about {t} in a {tone} tone.", "Write {form} set in {p}.",
    "Write {form} for {aud} about {t}.", "Draft an email to my team announcing a workshop on {t}.",
    "Write a {tone} toast for my friend {a}'s birthday.", "Write {form} in which {a} discovers {t}.",
    "Compose a {tone} message apologizing for missing a meeting about {t}.",
    "Write the opening paragraph of a mystery novel set in {p}.", "Write a persuasive paragraph arguing for {t}.",
    "Write a short review of an imaginary book about {t}.", "Rewrite this sentence to sound more {tone}: "
    "\"We need to talk about {t} tomorrow.\"", "Write a dialogue between {a} and {b} arguing about {t}.",
]
REASONING = [
    "{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain your reasoning.",
    "If all {x}s are {y}s and some {y}s are {z}s, can we conclude that some {x}s are {z}s? Explain.",
    "A farmer has a wolf, a goat and a cabbage and must cross a river in a boat that holds one item. How?",
    "{a}, {b} and {c} each own a different pet: a cat, a dog and a fish. {a} does not own the dog, and {b} owns the "
    "fish. Who owns which pet?", "What is the next number in the sequence {s}? Explain the pattern.",
    "Is the following argument valid? 'If it rains, the street is wet. The street is wet. So it rained.'",
    "Why do we have seasons on Earth? Think it through step by step.", "Which is heavier, a kilogram of {item} or a "
    "kilogram of feathers? Explain.", "A clock shows {h}:{mm}. What angle do the hour and minute hands make?",
    "Estimate how many {item} would fit in a school bus. Walk me through your estimate.",
    "There are {n} people at a party and each shakes hands with everyone else once. How many handshakes are there?",
    "What are the likely causes and effects of {t}? Reason step by step.",
    "If today is {day}, what day of the week will it be in {n} days?",
    "{a} says: 'If I finish my work on {t}, I will go to {p}.' {a} did not go to {p}. What can we conclude?",
    "{a} has {x} coins and {b} has {y}. How many coins must {a} give {b} so that they have the same number, and is "
    "that always possible? Explain.", "A bag holds {x} red and {y} blue {item}. What is the probability of drawing "
    "two red ones in a row without replacement? Reason it out.", "Which came first, {t} or {t2}? Explain how you "
    "know.", "Is it a good idea to study {t} before {t2}? Argue both sides, then decide.",
    "{a} always lies and {b} always tells the truth. One of them says 'I am {b}.' Who spoke? Explain.",
    "A snail climbs {x} m up a wall each day and slides back {z} m each night. The wall is {xy} m high. On which day "
    "does it reach the top? Think carefully.", "What assumptions hide in the claim that {t} always improves {t2}?",
]
MATH = [
    "{a} has {x} {item}. {b} gives {a} {y} more, then {a} gives away {z}. How many {item} does {a} have now?",
    "A shop sells {item} at ${p} each. {a} buys {x} of them and pays with a ${big} bill. How much change does {a} "
    "get?", "{a} reads {x} pages a day. How many days does it take to finish a book of {n} pages?",
    "A train travels {xy} km in {y} hours. At the same speed, how far does it go in {z} hours?",
    "{a} saves ${x} every week. After {y} weeks {a} spends ${z}. How much money is left?",
    "A jacket costs ${hundreds}. It is discounted by {pct}%. What is the new price?",
    "A rectangle is {x} cm long and {y} cm wide. What are its area and its perimeter?",
    "{a} and {b} share {xy_sum} {item} in the ratio {x}:{y}. How many does each get?",
    "Solve for x: {x}x + {y} = {n}.", "What is the sum of all integers from 1 to {n}?",
    "If {x} workers build a wall in {y} days, how long do {z} workers take at the same rate?",
    "Find the greatest common divisor and the least common multiple of {x} and {n}.",
    "{a} runs {x} km on Monday and {y} km more each day after that. How far does {a} run in total from Monday to "
    "Friday?", "A recipe needs {x} eggs for {y} servings. How many eggs are needed for {z4} servings?",
    "A bus has {seats} seats. {x} rows have {y} seats each and the rest are single seats. How many single seats are "
    "there?", "{a} is {x} years old. {b} is {y} years older than twice {a}'s age. How old is {b}?",
    "A tank holds {hundreds} liters and fills at {x} liters per minute. How long until it is full? Round up.",
    "The average of {x}, {y}, {z} and a fourth number is {avg}. What is the fourth number?",
    "A phone plan costs ${x} a month plus ${p} per gigabyte. {a} used {y} GB. What is the bill?",
    "{a} bought {x} packs of {item} with {y} in each pack and shared them equally among {z} friends. How many did "
    "each friend get, and how many were left over?", "What is {pct}% of {hundreds}?",
    "A square garden has a perimeter of {x4} m. What is its area?",
    "The ratio of boys to girls in a class is {x}:{y}. There are {xy_sum} students. How many girls are there?",
    "A car uses {x} liters of fuel per 100 km. How much fuel does it need for {hundreds} km?",
    "{a} earns ${hundreds} a week and spends {pct}% of it on rent. How much is left each week?",
]
MATH_SUFFIXES = ["", " Show your work.", " Explain each step.", " Think step by step, then give the final answer.",
                 " Give the final answer on its own line.", " Reason step by step and put the final answer in "
                 "\\boxed{{}}."]
CODE = [
    "Write a {lang} function that {task}.", "Write a {lang} program that {task}. Add comments.",
    "In {lang}, how do I write code that {task}?", "Write a function in {lang} that {task}, and explain its time "
    "complexity.", "Give me a {lang} snippet that {task}, with a short usage example.",
    "Write a {lang} function that {task}. Include two test cases.", "Show an idiomatic {lang} solution: a function "
    "that {task}.", "I am new to {lang}. Write a simple function that {task} and walk me through it.",
]
CODE_PY = [
    "Write a Python function that {task}. Use type hints and a docstring.",
    "Write a Python class that {task}.", "Write a recursive Python function that {task}.",
    "Write a Python function that {task}, then write pytest tests for it.",
    "Complete this Python function:\n```python\ndef solve(data):\n    \"\"\"A function that {task}.\"\"\"\n```",
]
CODE_MISC = [
    "Find and fix the bug in this {lang} code:\n```\n{snippet}\n```", "Explain what this {lang} code does:\n```\n"
    "{snippet}\n```", "Translate this {lang} code into {lang2}:\n```\n{snippet}\n```",
    "What is the difference between a list and a tuple in Python?", "Explain recursion with a {lang} example.",
    "How do I read a JSON file in {lang}?", "Explain what a closure is, with an example in {lang}.",
    "What does Big-O notation mean? Give {lang} examples of O(1), O(n) and O(n^2).",
    "Write a SQL query that finds the {n} customers with the highest total order value.",
    "Write a bash one-liner that counts the lines of every .{ext} file in a directory.",
    "Write a regular expression that matches {what}, and explain it.",
]
EXTS = ["py", "txt", "log", "csv", "md", "js", "c"]
REGEX_WHAT = ["US phone numbers", "dates like 2024-05-17", "hexadecimal colors like #ff8800", "IPv4 addresses",
              "words that start with a capital letter", "email addresses", "times like 14:30"]
CONSTRAINED = [
    "Explain {t}. {con}", "Write {form} about {t}. {con}", "Give me advice on {t}. {con} {con2}",
    "Describe {p} to a visitor. {con}", "List the main ideas of {t}. {con}", "Write a note to {a} about {t}. {con} {con2}",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _slots(rng: random.Random) -> dict:
    x, y = rng.randint(2, 40), rng.randint(2, 30)
    z = rng.randint(1, min(x, y))
    a, b, c = rng.sample(NAMES, 3)
    t, t2 = rng.sample(TOPICS, 2)
    start, step = rng.randint(1, 9), rng.randint(2, 7)
    seq = ", ".join(str(start + step * k) for k in range(5)) if rng.random() < 0.5 else \
        ", ".join(str(start * step ** k) for k in range(5))
    lang, lang2 = rng.sample(LANGUAGES, 2)
    return dict(
        a=a, b=b, c=c, t=t, t2=t2, p=rng.choice(PLACES), aud=rng.choice(AUDIENCES), tone=rng.choice(TONES),
        form=rng.choice(WRITING_FORMS), item=rng.choice(ITEMS), x=x, y=y, z=z, xy=x * y, xy_sum=(x + y) * rng.randint(2, 9),
        z4=y * rng.randint(2, 5), seats=x * y + rng.randint(1, 20), x4=4 * x, n=rng.randint(41, 500),
        big=rng.choice([20, 50, 100]),
        hundreds=rng.randrange(100, 2000, 20), pct=rng.choice([5, 10, 15, 20, 25, 30, 40, 50, 75]),
        avg=rng.randint(10, 60), h=rng.randint(1, 12), mm=rng.choice(["00", "15", "20", "30", "45"]),
        s=seq, day=rng.choice(DAYS), lang=lang, lang2=lang2, task=rng.choice(CODE_TASKS),
        con=rng.choice(CONSTRAINTS), con2=rng.choice(CONSTRAINTS), ext=rng.choice(EXTS), what=rng.choice(REGEX_WHAT))


def _fill(template: str, slots: dict, rng: random.Random) -> str:
    # "${p}" in the math templates is a price, "{p}" elsewhere a place.
    return template.replace("${p}", f"${rng.randint(1, 9)}").format(**slots)


def chat(rng):
    return dict(category="chat", turns=[_fill(rng.choice(CHAT), _slots(rng), rng)])


def writing(rng):
    return dict(category="writing", turns=[_fill(rng.choice(WRITING), _slots(rng), rng)])


def reasoning(rng):
    s = _slots(rng)
    s.update(x=rng.choice(["cat", "robot", "painter", "tree"]), y=rng.choice(["animal", "machine", "artist", "plant"]),
             z=rng.choice(["pet", "toy", "teacher", "oak"]))
    return dict(category="reasoning", turns=[_fill(rng.choice(REASONING), s, rng)])


def math(rng):
    return dict(category="math", turns=[_fill(rng.choice(MATH) + rng.choice(MATH_SUFFIXES), _slots(rng), rng)])


def code(rng):
    s = _slots(rng)
    r = rng.random()
    if r < 0.35:
        text = _fill(rng.choice(CODE_PY), s, rng)
    elif r < 0.75:
        text = _fill(rng.choice(CODE), s, rng)
    else:
        lang, snippet = rng.choice(BUGGY_SNIPPETS)
        s.update(lang=lang, lang2=rng.choice([x for x in LANGUAGES if x != lang]))
        text = rng.choice(CODE_MISC).replace("{snippet}", "@@SNIPPET@@").format(**s).replace("@@SNIPPET@@", snippet)
    return dict(category="code", turns=[text])


def constrained(rng):
    return dict(category="instructions", turns=[_fill(rng.choice(CONSTRAINED), _slots(rng), rng)])


def multi_turn(rng):
    first = rng.choice([chat, writing, code, math, reasoning, constrained])(rng)
    pool = FOLLOW_UPS + {"code": CODE_FOLLOW_UPS, "math": MATH_FOLLOW_UPS}.get(first["category"], []) * 2
    follow = rng.sample(pool, rng.choice([1, 1, 2]))
    return dict(category="multi-turn", turns=first["turns"] + follow)


GENERATORS = dict(chat=chat, writing=writing, reasoning=reasoning, math=math, code=code, instructions=constrained,
                  multi_turn=multi_turn)
# Shares of the template part of the corpus.
WEIGHTS = dict(chat=0.14, writing=0.14, reasoning=0.1, math=0.2, code=0.22, instructions=0.1, multi_turn=0.1)


def template_prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    kinds = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()), k=n)
    return [dict(source="templates", **GENERATORS[k](rng)) for k in kinds]
