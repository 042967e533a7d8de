"""Training prompts with graders: toy families or benchmark-format JSONL files.

Each item carries its prompt, its kind (for per-kind statistics) and a grader of a
completion; the toy world's problems and graders live in :mod:`cospec.toy.tasks`, the
benchmarks' in :mod:`eval.benchmarks` and :mod:`eval.graders`, and are used from there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from cospec.toy import tasks as toy_tasks


@dataclass(frozen=True)
class TaskItem:
    """One training prompt and how to grade a completion of it."""

    prompt: str
    family: str
    kind: str
    grader: Callable[[str], bool]

    def grade(self, completion: str) -> bool:
        return bool(self.grader(completion))


def _grade_benchmark(sample, completion: str) -> bool:
    from eval.graders import grade

    return grade(sample, completion).correct


def load_task_items(
    task: str, task_source: str | None, split: str, num_prompts: int, seed: int
) -> list[TaskItem]:
    """Prompts in a fixed order (prompt ``i`` is item ``i``): a toy family's split, or a
    benchmark-format file / dataset id. Shared by stage 0 and stage 2."""
    if task in toy_tasks.FAMILIES:
        problems = toy_tasks.generate(task, split, num_prompts, seed)
        return [TaskItem(p.prompt, p.family, p.kind, partial(toy_tasks.grade, p))
                for p in problems]
    from eval.benchmarks import load_benchmark

    samples = load_benchmark(task, task_source, limit=num_prompts)
    return [TaskItem(s.prompt, task, str(s.metadata.get("subject", task)),
                     partial(_grade_benchmark, s))
            for s in samples]


def task_stop_strings(task: str, stop_strings: list[str]) -> list[str]:
    """The configured stop strings plus a benchmark's own (base-model prompts run on)."""
    if task in toy_tasks.FAMILIES:
        return list(stop_strings)
    from eval.benchmarks import STOP_STRINGS

    return list(dict.fromkeys([*stop_strings, *STOP_STRINGS[task]]))
