"""Benchmark loaders and prompt builders: GSM8K, MATH-500, HumanEval and MBPP.

Every loader accepts a local JSONL file (the offline copies in ``shared/data``, field names
as upstream) or a Hub dataset id, read with ``datasets.load_dataset``; both paths produce
the same :class:`BenchmarkSample` list, so everything downstream is source-agnostic.

Each sample carries its base-model prompt (a completion prefix, few-shot where the
benchmark's convention is few-shot) and the bare question, from which :func:`chat_prompt`
builds a chat-model prompt with the tokenizer's own template. Base-model generation stops
at the benchmark's :data:`STOP_STRINGS`; chat models stop at their end-of-turn token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cospec.errors import CoSpecError

if TYPE_CHECKING:  # importing transformers costs seconds; only chat_prompt's caller needs it
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase


@dataclass(frozen=True)
class BenchmarkSample:
    """One evaluation item, whatever the benchmark.

    ``reference`` is the gold final answer (GSM8K, MATH-500) or the reference solution
    code (HumanEval, MBPP); ``metadata`` holds what grading and reports need beyond that
    (tests and entry point for code tasks, the worked solution, subject and level).
    """

    id: str
    benchmark: str
    question: str
    prompt: str
    reference: str
    metadata: dict[str, Any] = field(default_factory=dict)


STOP_STRINGS: dict[str, tuple[str, ...]] = {
    "gsm8k": ("\n\nQuestion:",),
    "math500": ("\n\nProblem:",),
    # The Codex paper's rule: stop at the next top-level statement after the function body.
    "humaneval": ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"),
    "mbpp": ("[DONE]",),
}


def truncate_at_stop(text: str, stop_strings: tuple[str, ...]) -> str:
    """Cut ``text`` at the earliest stop string (generation may emit it, or run past it)."""
    cut = min((i for s in stop_strings if (i := text.find(s)) != -1), default=len(text))
    return text[:cut]


# Few-shot exemplars written for this project (not drawn from any test set), in each
# benchmark's answer format so a base model learns where the graded answer goes.
_GSM8K_SHOTS = (
    (
        "A baker makes 24 muffins in the morning and 18 muffins in the afternoon. She sells "
        "30 of them. How many muffins does she have left?",
        "She makes 24 + 18 = 42 muffins. After selling 30 she has 42 - 30 = 12 muffins left."
        "\n#### 12",
    ),
    (
        "Tom reads 15 pages a day for 6 days and 20 pages on the seventh day. How many pages "
        "does he read that week?",
        "In the first 6 days he reads 15 * 6 = 90 pages. With the seventh day he reads "
        "90 + 20 = 110 pages.\n#### 110",
    ),
    (
        "A shirt costs $25 and is on sale for 20% off. How much do 3 shirts cost on sale?",
        "The discount is 25 * 20 / 100 = 5 dollars, so one shirt costs 25 - 5 = 20 dollars. "
        "Three shirts cost 3 * 20 = 60 dollars.\n#### 60",
    ),
    (
        "A train travels at 60 miles per hour for 2.5 hours, then at 40 miles per hour for "
        "1 hour. How many miles does it travel in total?",
        "First it travels 60 * 2.5 = 150 miles, then 40 * 1 = 40 miles. In total it travels "
        "150 + 40 = 190 miles.\n#### 190",
    ),
)

_MATH_SHOTS = (
    (
        "What is the value of $3^2 + 4^2$?",
        "We have $3^2 = 9$ and $4^2 = 16$, so the sum is $9 + 16 = 25$. "
        "The final answer is $\\boxed{25}$.",
    ),
    (
        "Solve for $x$: $2x + 5 = 17$.",
        "Subtracting 5 from both sides gives $2x = 12$, so $x = 6$. "
        "The final answer is $\\boxed{6}$.",
    ),
    (
        "Simplify $\\frac{6}{8} + \\frac{1}{4}$.",
        "Since $\\frac{6}{8} = \\frac{3}{4}$, the sum is $\\frac{3}{4} + \\frac{1}{4} = 1$. "
        "The final answer is $\\boxed{1}$.",
    ),
)

_MATH_HEADER = "Solve each problem step by step and put the final answer in \\boxed{}.\n\n"

MBPP_TEST_IDS = range(11, 511)
MBPP_SHOT_IDS = (2, 3, 4)


def _gsm8k_prompt(question: str) -> str:
    shots = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in _GSM8K_SHOTS)
    return f"{shots}Question: {question}\nAnswer:"


def _math_prompt(problem: str) -> str:
    shots = "".join(f"Problem:\n{p}\n\nSolution:\n{s}\n\n" for p, s in _MATH_SHOTS)
    return f"{_MATH_HEADER}{shots}Problem:\n{problem}\n\nSolution:\n"


def _mbpp_task(text: str, tests: list[str]) -> str:
    """The task statement in the MBPP paper's prompt format."""
    joined = "\n".join(tests)
    return (
        f"You are an expert Python programmer, and here is your task: {text} "
        f"Your code should pass these tests:\n\n{joined}\n"
    )


def _mbpp_prompt(row: dict[str, Any], shots: list[dict[str, Any]]) -> str:
    examples = "".join(
        f"{_mbpp_task(s['text'], s['test_list'])}[BEGIN]\n{_unix(s['code'])}\n[DONE]\n\n"
        for s in shots
    )
    return f"{examples}{_mbpp_task(row['text'], row['test_list'])}[BEGIN]\n"


def _unix(code: str) -> str:
    """MBPP stores code with ``\\r\\n``; prompts use plain newlines."""
    return code.replace("\r\n", "\n").strip()


# ---------------------------------------------------------------------------- reading rows


def _is_local(source: str) -> bool:
    """Local file or Hub id? Hub ids look like ``owner/name``; paths exist or look like paths."""
    return (
        source.endswith(".jsonl")
        or source.startswith(("/", ".", "~"))
        or Path(source).expanduser().exists()
    )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise CoSpecError(f"benchmark file not found: {path}")
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise CoSpecError(f"{path}:{line_no}: not valid JSON ({e.msg})") from e
    return rows


def _load_rows(source: str, hub_config: str | None, hub_split: str) -> list[dict[str, Any]]:
    """Rows of a local JSONL file, or of ``hub_config``/``hub_split`` of a Hub dataset."""
    if _is_local(source):
        return _read_jsonl(Path(source).expanduser())
    # Imported here: ``datasets`` takes seconds to import and offline runs never need it.
    from datasets import load_dataset

    try:
        dataset = load_dataset(source, hub_config, split=hub_split)
    except (FileNotFoundError, ConnectionError, ValueError) as e:
        raise CoSpecError(f"could not load {source!r} from the Hub: {e}") from e
    return [dict(row) for row in dataset]


def _convert(
    source: str,
    rows: list[dict[str, Any]],
    make: Callable[[int, dict[str, Any]], BenchmarkSample],
) -> list[BenchmarkSample]:
    """Turn rows into samples; a row without an expected field is the user's file's fault."""
    samples = []
    for index, row in enumerate(rows):
        try:
            samples.append(make(index, row))
        except KeyError as e:
            raise CoSpecError(f"{source}: row {index} has no field {e}") from e
    return samples


# ----------------------------------------------------------------------------------- loaders


def load_gsm8k(source: str) -> list[BenchmarkSample]:
    """GSM8K test (1319 rows; Hub: ``openai/gsm8k``). Reference: the text after ``####``."""

    def make(index: int, row: dict[str, Any]) -> BenchmarkSample:
        return BenchmarkSample(
            id=f"gsm8k/{index}",
            benchmark="gsm8k",
            question=row["question"],
            prompt=_gsm8k_prompt(row["question"]),
            reference=row["answer"].rsplit("####", 1)[-1].strip(),
            metadata={"solution": row["answer"]},
        )

    return _convert(source, _load_rows(source, "main", "test"), make)


def load_math500(source: str) -> list[BenchmarkSample]:
    """MATH-500 (500 rows; Hub: ``HuggingFaceH4/MATH-500``). Reference: the ``answer`` field."""

    def make(index: int, row: dict[str, Any]) -> BenchmarkSample:
        return BenchmarkSample(
            id=row["unique_id"],
            benchmark="math500",
            question=row["problem"],
            prompt=_math_prompt(row["problem"]),
            reference=row["answer"],
            metadata={
                "solution": row["solution"],
                "subject": row["subject"],
                "level": row["level"],
            },
        )

    return _convert(source, _load_rows(source, None, "test"), make)


def load_humaneval(source: str) -> list[BenchmarkSample]:
    """HumanEval (164 rows; Hub: ``openai/openai_humaneval``); the prompt is the prefix."""

    def make(index: int, row: dict[str, Any]) -> BenchmarkSample:
        return BenchmarkSample(
            id=row["task_id"],
            benchmark="humaneval",
            question=row["prompt"],
            prompt=row["prompt"],
            reference=row["canonical_solution"],
            metadata={"test": row["test"], "entry_point": row["entry_point"]},
        )

    return _convert(source, _load_rows(source, None, "test"), make)


def load_mbpp(source: str) -> list[BenchmarkSample]:
    """MBPP test ids 11-510, 3-shot from ids 2, 3, 4 (Hub: ``google-research-datasets/mbpp``).

    A local file must be the full ``mbpp.jsonl`` (all 974 rows), which holds both the test
    ids and the prompt ids; on the Hub they are the ``test`` and ``prompt`` splits of the
    ``full`` configuration.
    """
    if _is_local(source):
        rows = prompt_rows = _read_jsonl(Path(source).expanduser())
    else:
        rows = _load_rows(source, "full", "test")
        prompt_rows = _load_rows(source, "full", "prompt")
    by_id = {row.get("task_id"): row for row in prompt_rows}
    missing = [i for i in MBPP_SHOT_IDS if i not in by_id]
    if missing:
        raise CoSpecError(f"{source}: MBPP task ids {missing} (the 3-shot examples) are missing")
    shots = [by_id[i] for i in MBPP_SHOT_IDS]

    def make(index: int, row: dict[str, Any]) -> BenchmarkSample:
        return BenchmarkSample(
            id=f"mbpp/{row['task_id']}",
            benchmark="mbpp",
            question=row["text"],
            prompt=_mbpp_prompt(row, shots),
            reference=row["code"],
            metadata={
                "test_list": row["test_list"],
                "test_setup_code": row["test_setup_code"],
                "challenge_test_list": row["challenge_test_list"],
            },
        )

    test_rows = [row for row in rows if row.get("task_id") in MBPP_TEST_IDS]
    return _convert(source, test_rows, make)


BENCHMARKS: dict[str, Callable[[str], list[BenchmarkSample]]] = {
    "gsm8k": load_gsm8k,
    "math500": load_math500,
    "humaneval": load_humaneval,
    "mbpp": load_mbpp,
}


def load_benchmark(name: str, source: str, limit: int | None = None) -> list[BenchmarkSample]:
    """Load benchmark ``name`` from ``source`` (JSONL path or Hub id); the first ``limit``."""
    if name not in BENCHMARKS:
        raise CoSpecError(f"unknown benchmark {name!r}; choose from {sorted(BENCHMARKS)}")
    if limit is not None and limit <= 0:
        raise CoSpecError(f"benchmark limit must be positive, got {limit}")
    return BENCHMARKS[name](source)[:limit]


# ------------------------------------------------------------------------------ chat prompts


def _chat_message(sample: BenchmarkSample) -> str:
    """The user turn: the bare task plus where to put the answer so the grader finds it."""
    if sample.benchmark == "gsm8k":
        return (
            f"{sample.question}\n\nSolve the problem step by step. Then write the final "
            'answer as a number on its own last line, in the form "#### <number>".'
        )
    if sample.benchmark == "math500":
        return (
            f"{sample.question}\n\nPlease reason step by step, and put your final answer "
            "within \\boxed{}."
        )
    if sample.benchmark == "humaneval":
        return (
            "Complete the following Python function. Reply with the complete function in a "
            f"single ```python code block.\n\n```python\n{sample.question}```"
        )
    if sample.benchmark == "mbpp":
        tests = "\n".join(sample.metadata["test_list"])
        return (
            f"{sample.question}\nYour code should pass these tests:\n\n{tests}\n\n"
            "Reply with the code in a single ```python code block."
        )
    raise CoSpecError(f"unknown benchmark {sample.benchmark!r}; choose from {sorted(BENCHMARKS)}")


def chat_prompt(sample: BenchmarkSample, tokenizer: PreTrainedTokenizerBase) -> str:
    """The prompt for a chat model: one user turn through the tokenizer's chat template."""
    if tokenizer.chat_template is None:
        raise CoSpecError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template; use the base prompt"
        )
    messages = [{"role": "user", "content": _chat_message(sample)}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
