"""Graders: is a completion correct for its :class:`~eval.benchmarks.BenchmarkSample`?

GSM8K compares the final number (a strict ``#### N`` rule and a flexible last-number rule,
as lm-evaluation-harness reports both); MATH-500 uses ``math-verify`` (gold parsed first,
then the prediction); HumanEval and MBPP run the program against the tests in
:mod:`eval.sandbox`. :func:`grade` dispatches on the sample's benchmark.

Completions are first cut at the benchmark's stop strings, so a base model that ran past
its answer into an invented next few-shot question is graded on its answer only. For code
tasks a fenced ```python block, which chat models produce, is taken instead.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from math_verify import parse, verify

from cospec.errors import CoSpecError
from eval.benchmarks import STOP_STRINGS, BenchmarkSample, truncate_at_stop
from eval.sandbox import DEFAULT_TIMEOUT_S, run_untrusted

MATH_VERIFY_TIMEOUT_S = 5


@dataclass(frozen=True)
class GradeResult:
    """``correct`` is the benchmark's headline metric; ``details`` is JSON-ready context."""

    correct: bool
    details: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------- GSM8K

_NUMBER = r"-?[\d,]*\.?\d+"
_STRICT_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def normalize_number(text: str) -> str | None:
    """``"1,000"``, ``"1000.00"`` and ``"1000"`` all become ``"1000"``; None if not a number."""
    try:
        value = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_gsm8k_strict(text: str) -> str | None:
    """The number after the first ``####`` (GSM8K's own answer format), normalised."""
    match = _STRICT_ANSWER.search(text)
    return normalize_number(match.group(1)) if match else None


def extract_gsm8k_flexible(text: str) -> str | None:
    """The last number anywhere in the text, normalised: forgiving of a missing ``####``."""
    numbers = _ANY_NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def grade_gsm8k(sample: BenchmarkSample, completion: str) -> GradeResult:
    """Both rules; ``correct`` is the strict one, the format the prompts ask for."""
    text = truncate_at_stop(completion, STOP_STRINGS["gsm8k"])
    gold = normalize_number(sample.reference)
    strict = extract_gsm8k_strict(text)
    flexible = extract_gsm8k_flexible(text)
    strict_ok = strict is not None and strict == gold
    flexible_ok = flexible is not None and flexible == gold
    return GradeResult(
        correct=strict_ok,
        details={
            "gold": gold,
            "strict_answer": strict,
            "flexible_answer": flexible,
            "strict_correct": strict_ok,
            "flexible_correct": flexible_ok,
        },
    )


# ------------------------------------------------------------------------------ MATH-500


def grade_math(sample: BenchmarkSample, completion: str) -> GradeResult:
    """math-verify equivalence of the completion's final answer to the gold answer.

    math-verify bounds parsing and comparison with ``signal.alarm``, which only works in
    the main thread and makes it raise elsewhere. Off the main thread the bound is switched
    off instead, so nothing stops a pathological expression there: grade MATH in the main
    thread (a few milliseconds an answer) or in worker processes, not in a thread pool.
    """
    timeout = (
        MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    )
    text = truncate_at_stop(completion, STOP_STRINGS["math500"])
    gold = parse(f"\\boxed{{{sample.reference}}}", parsing_timeout=timeout)
    predicted = parse(text, parsing_timeout=timeout)
    correct = bool(gold and predicted) and verify(gold, predicted, timeout_seconds=timeout)
    return GradeResult(
        correct=correct,
        details={"gold": sample.reference, "extracted": str(predicted[-1]) if predicted else None},
    )


# ---------------------------------------------------------------------------------- code

_FENCED_CODE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(completion: str, stop_strings: tuple[str, ...]) -> str:
    """The first fenced code block (chat models), else the completion cut at the stops.

    An unclosed fence (generation hit its token limit) still yields the code after it.
    """
    fenced = _FENCED_CODE.search(completion)
    if fenced:
        return fenced.group(1)
    return truncate_at_stop(completion, stop_strings)


def _grade_program(program: str, timeout_s: float) -> GradeResult:
    result = run_untrusted(program, timeout_s=timeout_s)
    return GradeResult(
        correct=result.passed,
        details={
            "reason": result.reason,
            "timed_out": result.timed_out,
            "stderr": result.stderr,
            "wall_s": round(result.wall_s, 3),
        },
    )


def humaneval_program(sample: BenchmarkSample, completion: str) -> str:
    """Prompt + completion, then the benchmark's ``check`` on the entry point.

    A chat model's code block usually repeats the whole function; after the prompt's
    docstring-only stub that is simply a redefinition, so the same program works for both.
    """
    code = extract_code(completion, STOP_STRINGS["humaneval"])
    test, entry_point = sample.metadata["test"], sample.metadata["entry_point"]
    return f"{sample.question}{code}\n\n{test}\n\ncheck({entry_point})\n"


def mbpp_program(sample: BenchmarkSample, completion: str) -> str:
    """Code, then ``test_setup_code`` (it may use the code's classes), then the asserts."""
    code = extract_code(completion, STOP_STRINGS["mbpp"])
    tests = "\n".join(sample.metadata["test_list"])
    return f"{code}\n\n{sample.metadata['test_setup_code']}\n\n{tests}\n"


def grade_humaneval(
    sample: BenchmarkSample, completion: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> GradeResult:
    """Run the HumanEval program in the sandbox; correct when every check passes."""
    return _grade_program(humaneval_program(sample, completion), timeout_s)


def grade_mbpp(
    sample: BenchmarkSample, completion: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> GradeResult:
    """Run the MBPP program in the sandbox; correct when every assert in ``test_list`` holds."""
    return _grade_program(mbpp_program(sample, completion), timeout_s)


GRADERS: dict[str, Callable[[BenchmarkSample, str], GradeResult]] = {
    "gsm8k": grade_gsm8k,
    "math500": grade_math,
    "humaneval": grade_humaneval,
    "mbpp": grade_mbpp,
}


def grade(sample: BenchmarkSample, completion: str) -> GradeResult:
    """Grade ``completion`` with its sample's benchmark grader."""
    grader = GRADERS.get(sample.benchmark)
    if grader is None:
        raise CoSpecError(f"no grader for benchmark {sample.benchmark!r}; have {sorted(GRADERS)}")
    return grader(sample, completion)
