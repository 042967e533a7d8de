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
from data_gen.config import DataGenConfig


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


def load_task_items(config: DataGenConfig) -> list[TaskItem]:
    """The run's prompts in a fixed order (prompt ``i`` is item ``i``)."""
    if config.is_toy:
        problems = toy_tasks.generate(config.task, config.split, config.num_prompts,
                                      config.seed)
        return [TaskItem(p.prompt, p.family, p.kind, partial(toy_tasks.grade, p))
                for p in problems]
    from eval.benchmarks import load_benchmark

    samples = load_benchmark(config.task, config.task_source, limit=config.num_prompts)
    return [TaskItem(s.prompt, config.task, str(s.metadata.get("subject", config.task)),
                     partial(_grade_benchmark, s))
            for s in samples]


def task_stop_strings(config: DataGenConfig) -> list[str]:
    """The configured stop strings plus a benchmark's own (base-model prompts run on)."""
    if config.is_toy:
        return list(config.stop_strings)
    from eval.benchmarks import STOP_STRINGS

    return list(dict.fromkeys([*config.stop_strings, *STOP_STRINGS[config.task]]))
