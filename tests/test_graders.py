"""Graders against the benchmarks' own gold data: every reference must grade correct.

The independent references are the datasets themselves: GSM8K's ``#### N`` lines, the
``\\boxed{}`` in MATH-500's worked solutions, HumanEval's canonical solutions and MBPP's
reference code, each of which must pass its own tests, and wrong answers that must not.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cospec.errors import CoSpecError
from eval.benchmarks import BenchmarkSample, load_benchmark
from eval.graders import (
    GradeResult,
    extract_gsm8k_flexible,
    extract_gsm8k_strict,
    grade,
    grade_humaneval,
    grade_mbpp,
    normalize_number,
)

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"
WORKERS = min(4, os.cpu_count() or 2)
CODE_TIMEOUT_S = 60.0


def _load(name: str, file: str) -> list[BenchmarkSample]:
    path = DATA_DIR / file
    if not path.is_file():
        pytest.skip(f"offline benchmark file {path} is not present")
    return load_benchmark(name, str(path))


def _run_code(
    grader: Callable[[BenchmarkSample, str, float], GradeResult],
    pairs: list[tuple[BenchmarkSample, str]],
) -> list[GradeResult]:
    """Grade in a thread pool: each sample is a subprocess, so threads overlap them.

    The timeout is generous because the machine is shared: mbpp/123's reference alone
    takes ~4 s of CPU, and these tests check correctness, not speed.
    """
    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(lambda pair: grader(*pair, CODE_TIMEOUT_S), pairs))


def _sample(benchmark: str, reference: str, **metadata: object) -> BenchmarkSample:
    return BenchmarkSample("t/0", benchmark, "q", "p", reference, dict(metadata))


# --------------------------------------------------------------------------------- GSM8K


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1,000", "1000"),
        ("18.00", "18"),
        ("-3", "-3"),
        ("0.50", "0.5"),
        (".5", "0.5"),
        ("abc", None),
        ("", None),
    ],
)
def test_normalize_number(text: str, expected: str | None) -> None:
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("3 + 4 = 7\n#### 1,234", "1234", "1234"),
        ("So she pays $18.00.\n#### $18.00", "18", "18"),
        ("#### -5\nThen 7 more.", "-5", "7"),
        ("The answer is 42.", None, "42"),
        ("It costs $1,000.50 in total.", None, "1000.5"),
        ("No numbers here.", None, None),
    ],
)
def test_gsm8k_extraction(text: str, strict: str | None, flexible: str | None) -> None:
    assert extract_gsm8k_strict(text) == strict
    assert extract_gsm8k_flexible(text) == flexible


def test_gsm8k_strict_extraction_recovers_every_gold_answer() -> None:
    samples = _load("gsm8k", "gsm8k_test.jsonl")
    assert len(samples) == 1319
    for sample in samples:
        solution = sample.metadata["solution"]
        gold = int(solution.splitlines()[-1].removeprefix("#### ").replace(",", ""))
        assert extract_gsm8k_strict(solution) == str(gold), sample.id
        result = grade(sample, solution)
        assert result.details["strict_correct"] and result.details["flexible_correct"], sample.id
        assert not grade(sample, f"#### {gold + 1}").correct, sample.id


def test_gsm8k_grades_only_up_to_the_stop_string() -> None:
    sample = _sample("gsm8k", "18")
    completion = " 9 * 2 = 18\n#### 18\n\nQuestion: What is 2 + 3?\nAnswer: 2 + 3 = 5\n#### 5"
    result = grade(sample, completion)
    assert result.correct and result.details["flexible_correct"]
    assert not grade(_sample("gsm8k", "5"), completion).details["flexible_correct"]


# ------------------------------------------------------------------------------ MATH-500


def test_math500_every_gold_answer_verifies() -> None:
    """Against itself in ``\\boxed{}``, and against the worked solution's own box."""
    samples = _load("math500", "math500_test.jsonl")
    assert len(samples) == 500
    for sample in samples:
        boxed = f"So the answer is $\\boxed{{{sample.reference}}}$."
        assert grade(sample, boxed).correct, sample.id
        assert grade(sample, sample.metadata["solution"]).correct, sample.id


@pytest.mark.parametrize(
    ("gold", "completion", "correct"),
    [
        ("\\frac{14}{3}", "Thus $x = \\boxed{\\dfrac{14}{3}}$.", True),
        ("\\frac{14}{3}", "Thus $x = \\boxed{\\frac{3}{14}}$.", False),
        ("\\frac{1}{2}", "The answer is $\\boxed{0.5}$.", True),
        ("2\\sqrt{2}", "The answer is $\\boxed{\\sqrt{8}}$.", True),
        ("3", "I do not know.", False),
        ("3", "$\\boxed{3}$\n\nProblem:\nWhat is 2+2?\n\nSolution:\n$\\boxed{4}$", True),
        ("4", "$\\boxed{3}$\n\nProblem:\nWhat is 2+2?\n\nSolution:\n$\\boxed{4}$", False),
    ],
)
def test_math_grading(gold: str, completion: str, correct: bool) -> None:
    assert grade(_sample("math500", gold), completion).correct is correct


def test_math_grading_works_off_the_main_thread() -> None:
    """math-verify's default signal-based timeout would raise here."""
    sample = _sample("math500", "\\frac{14}{3}")
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(grade, sample, "$\\boxed{\\frac{14}{3}}$").result().correct


# ---------------------------------------------------------------------------------- code


@pytest.mark.slow
def test_humaneval_canonical_solutions_pass_and_a_wrong_body_fails() -> None:
    samples = _load("humaneval", "humaneval.jsonl")
    assert len(samples) == 164
    canonical = _run_code(grade_humaneval, [(s, s.reference) for s in samples])
    assert [s.id for s, r in zip(samples, canonical, strict=True) if not r.correct] == []
    wrong = _run_code(grade_humaneval, [(s, "    return None\n") for s in samples])
    assert [s.id for s, r in zip(samples, wrong, strict=True) if r.correct] == []


@pytest.fixture(scope="module")
def humaneval_0() -> BenchmarkSample:
    return _load("humaneval", "humaneval.jsonl")[0]


@pytest.mark.parametrize(
    ("make_completion", "correct"),
    [
        (lambda s: s.reference + "\n\ndef unrelated():\n    return 1\n", True),
        (lambda s: f"Here it is:\n```python\n{s.question}{s.reference}```\nDone.", True),
        (lambda s: f"```python\n{s.question}{s.reference}", True),
        (lambda s: "    return False\n", False),
        (lambda s: "    import sys\n    sys.exit(0)\n", False),
    ],
    ids=["base-with-run-on", "chat-whole-function", "chat-unclosed-fence", "wrong", "early-exit"],
)
def test_humaneval_completion_forms(
    make_completion: Callable[[BenchmarkSample], str], correct: bool, humaneval_0: BenchmarkSample
) -> None:
    result = grade(humaneval_0, make_completion(humaneval_0))
    assert result.correct is correct, result.details


def test_code_that_hangs_is_incorrect(humaneval_0: BenchmarkSample) -> None:
    result = grade_humaneval(humaneval_0, "    while True:\n        pass\n", timeout_s=1.0)
    assert not result.correct
    assert result.details["timed_out"]


# Reference solutions of MBPP test ids that fail their own tests upstream. None do in this
# copy of mbpp.jsonl (task 341 is the fixed, deterministic version; see data/README.md).
MBPP_KNOWN_BAD_REFERENCES: set[int] = set()


@pytest.mark.slow
def test_mbpp_reference_code_passes_its_tests() -> None:
    samples = _load("mbpp", "mbpp.jsonl")
    assert [s.id for s in samples] == [f"mbpp/{i}" for i in range(11, 511)]
    results = _run_code(grade_mbpp, [(s, s.reference) for s in samples])
    failing = {
        int(s.id.split("/")[1]) for s, r in zip(samples, results, strict=True) if not r.correct
    }
    assert failing == MBPP_KNOWN_BAD_REFERENCES


@pytest.mark.parametrize(
    ("make_completion", "correct"),
    [
        (lambda code: f"{code}\n[DONE]\n\nYou are an expert Python programmer, ...", True),
        (lambda code: f"Sure.\n```python\n{code}\n```\n", True),
        (lambda code: "def remove_Occ(s, ch):\n    return s\n", False),
        (lambda code: "import sys\nsys.exit(0)\n", False),
    ],
    ids=["base-with-done", "chat-fenced", "wrong", "early-exit"],
)
def test_mbpp_completion_forms(make_completion: Callable[[str], str], correct: bool) -> None:
    sample = _load("mbpp", "mbpp.jsonl")[0]
    assert sample.id == "mbpp/11"
    assert grade(sample, make_completion(sample.reference)).correct is correct


def test_grade_rejects_an_unknown_benchmark() -> None:
    with pytest.raises(CoSpecError, match="no grader for benchmark 'nope'"):
        grade(_sample("nope", "1"), "1")
