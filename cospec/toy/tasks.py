"""Synthetic task families of the toy world, each with checkable answers.

Every family is a seeded generator of :class:`Problem` objects plus a grader. Problems are
written like GSM8K items: a question, a short chain of thought and a final ``#### answer``
line, so the same answer extraction serves the toy world and GSM8K.

Train and test splits are disjoint by construction: a question belongs to the test split
when a hash of its text falls in the test bucket, so no generator seed can leak a test
question into training data.
"""

from __future__ import annotations

import hashlib
import random
import string
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from cospec.errors import CoSpecError

ANSWER_MARKER = "####"
TEST_FRACTION_PERCENT = 20

_NAMES = [
    ("Tom", "He"),
    ("Ann", "She"),
    ("Bob", "He"),
    ("Eva", "She"),
    ("Sam", "He"),
    ("Mia", "She"),
    ("Leo", "He"),
    ("Zoe", "She"),
]
_OBJECTS = ["apples", "pens", "cards", "books", "eggs", "coins"]
_WORDS = [
    "cat",
    "dog",
    "sun",
    "map",
    "cup",
    "pen",
    "box",
    "hat",
    "bag",
    "egg",
    "fox",
    "owl",
    "bee",
    "ant",
    "cow",
    "pig",
    "hen",
    "jam",
    "ink",
    "oak",
    "bird",
    "fish",
    "frog",
    "lamp",
    "door",
    "rose",
    "star",
    "moon",
    "tree",
    "leaf",
    "rain",
    "snow",
    "wind",
    "fire",
    "rock",
    "sand",
    "milk",
    "corn",
    "rice",
    "bean",
    "cake",
    "salt",
    "seed",
    "wolf",
    "bear",
    "deer",
    "duck",
    "goat",
    "lion",
    "mole",
    "seal",
    "swan",
    "apple",
    "bread",
    "chair",
    "clock",
    "cloud",
    "dream",
    "field",
    "grass",
    "heart",
    "house",
    "knife",
    "lemon",
    "music",
    "night",
    "ocean",
    "paper",
    "plant",
    "river",
    "round",
    "sheep",
    "smile",
    "stone",
    "table",
    "tiger",
    "toast",
    "train",
    "water",
    "whale",
    "zebra",
]


@dataclass(frozen=True)
class Problem:
    """One task instance. ``solution`` is the reference completion after ``prompt``."""

    family: str
    kind: str
    question: str
    solution: str
    answer: str

    @property
    def prompt(self) -> str:
        return format_prompt(self.question)

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def format_prompt(question: str) -> str:
    """The toy world's prompt template; completions start right after ``A:``."""
    return f"Q: {question}\nA:"


def split_of(question: str) -> str:
    """Deterministic split assignment by question text (disjoint train/test)."""
    bucket = int(hashlib.sha1(question.encode()).hexdigest(), 16) % 100
    return "test" if bucket < TEST_FRACTION_PERCENT else "train"


def _with_answer(steps: str, answer: object) -> str:
    return f" {steps}\n{ANSWER_MARKER} {answer}"


def _math_add(rng: random.Random) -> tuple[str, str, str]:
    (name, pron), obj = rng.choice(_NAMES), rng.choice(_OBJECTS)
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    q = f"{name} has {a} {obj}. {pron} gets {b} more. How many {obj} does {name} have now?"
    return q, _with_answer(f"{a}+{b}={a + b}", a + b), str(a + b)


def _math_sub(rng: random.Random) -> tuple[str, str, str]:
    (name, pron), obj = rng.choice(_NAMES), rng.choice(_OBJECTS)
    b = rng.randint(1, 19)
    a = rng.randint(b + 1, 20)
    q = f"{name} has {a} {obj}. {pron} gives away {b}. How many {obj} are left?"
    return q, _with_answer(f"{a}-{b}={a - b}", a - b), str(a - b)


def _math_mul_add(rng: random.Random) -> tuple[str, str, str]:
    (name, _), obj = rng.choice(_NAMES), rng.choice(_OBJECTS)
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 20)
    q = f"{name} has {a} boxes of {b} {obj} and {c} loose {obj}. How many {obj} in total?"
    steps = f"{a}*{b}={a * b}\n{a * b}+{c}={a * b + c}"
    return q, _with_answer(steps, a * b + c), str(a * b + c)


def _math_div(rng: random.Random) -> tuple[str, str, str]:
    (name, _), obj = rng.choice(_NAMES), rng.choice(_OBJECTS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    q = f"{name} shares {a * b} {obj} equally among {b} friends. How many {obj} does each get?"
    return q, _with_answer(f"{a * b}/{b}={a}", a), str(a)


def _letters(rng: random.Random) -> str:
    """A random lowercase string: unseen strings force the model to learn the operation."""
    return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 5)))


def _string_reverse(rng: random.Random) -> tuple[str, str, str]:
    w = _letters(rng)
    return f"Reverse the word {w}.", _with_answer(f"{w} reversed is {w[::-1]}", w[::-1]), w[::-1]


def _string_capitalise(rng: random.Random) -> tuple[str, str, str]:
    w = _letters(rng)
    cap = w.capitalize()
    return f"Capitalize the word {w}.", _with_answer(f"{w} capitalized is {cap}", cap), cap


def _string_initials(rng: random.Random) -> tuple[str, str, str]:
    words = rng.sample(_WORDS, 3)
    joined = "".join(w[0] for w in words)
    steps = "first letters are " + " ".join(w[0] for w in words)
    return f"Join the first letters of {' '.join(words)}.", _with_answer(steps, joined), joined


_Generator = Callable[[random.Random], tuple[str, str, str]]

FAMILIES: dict[str, dict[str, _Generator]] = {
    "math": {"add": _math_add, "sub": _math_sub, "mul-add": _math_mul_add, "div": _math_div},
    "string": {
        "reverse": _string_reverse,
        "capitalise": _string_capitalise,
        "initials": _string_initials,
    },
}


def check_family(family: str) -> dict[str, _Generator]:
    """Return the kinds of ``family`` or raise a one-line error naming the valid ones."""
    if family not in FAMILIES:
        raise CoSpecError(f"unknown task family {family!r}; choose from {sorted(FAMILIES)}")
    return FAMILIES[family]


def generate(
    family: str,
    split: str,
    n: int,
    seed: int,
    kind_weights: dict[str, float] | None = None,
) -> list[Problem]:
    """Draw ``n`` problems of ``family`` from ``split`` ("train" or "test").

    ``kind_weights`` sets the mixture over kinds (missing kinds get weight 0); by default
    kinds are uniform. Test problems are distinct questions; training draws may repeat.
    """
    kinds = check_family(family)
    if split not in ("train", "test"):
        raise CoSpecError(f"unknown split {split!r}; choose 'train' or 'test'")
    weights = kind_weights or dict.fromkeys(kinds, 1.0)
    unknown = set(weights) - set(kinds)
    if unknown:
        raise CoSpecError(f"unknown kinds {sorted(unknown)} for family {family!r}")
    names = [k for k in weights if weights[k] > 0]
    rng = random.Random(f"{family}/{split}/{seed}")
    seen: set[str] = set()
    problems: list[Problem] = []
    attempts = 0
    while len(problems) < n:
        attempts += 1
        if attempts > 1000 * (n + 10):
            raise CoSpecError(f"cannot draw {n} distinct {split} problems of {family!r}")
        kind = rng.choices(names, weights=[weights[k] for k in names])[0]
        question, solution, answer = kinds[kind](rng)
        if split_of(question) != split or (split == "test" and question in seen):
            continue
        seen.add(question)
        problems.append(Problem(family, kind, question, solution, answer))
    return problems


def extract_answer(completion: str) -> str | None:
    """The text after the last ``####`` marker, first line only, or None if absent."""
    if ANSWER_MARKER not in completion:
        return None
    tail = completion.rsplit(ANSWER_MARKER, 1)[1].strip()
    return tail.splitlines()[0].strip() if tail else None


def grade(problem: Problem, completion: str) -> bool:
    """Exact-match grading of the final answer; math answers compare as integers."""
    predicted = extract_answer(completion)
    if predicted is None:
        return False
    if problem.family == "math":
        try:
            return int(predicted.replace(",", "")) == int(problem.answer)
        except ValueError:
            return False
    return predicted == problem.answer


def per_kind(problems: Sequence[Problem], correct: Sequence[bool]) -> dict[str, float]:
    """Accuracy per kind, for reports."""
    totals: dict[str, list[int]] = {}
    for p, ok in zip(problems, correct, strict=True):
        t = totals.setdefault(p.kind, [0, 0])
        t[0] += int(ok)
        t[1] += 1
    return {k: c / n for k, (c, n) in sorted(totals.items())}
