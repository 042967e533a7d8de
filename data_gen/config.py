"""Stage 0 configuration: one dataclass, read from ``--config file.yaml`` plus CLI overrides.

Field names follow the engine's (``num_draft_tokens`` is K) and SPEC.md 3.1's words: the
*draft branch* keeps the draft token at a mismatch, the *target branch* is the rollout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from cospec.errors import CoSpecError
from cospec.toy.tasks import FAMILIES

BENCHMARK_TASKS = ("gsm8k", "math500", "humaneval", "mbpp")
JUDGES = ("outcome", "model")
# Fields that do not change what is written: a run may resume with other values.
RESUMABLE_FIELDS = ("output_dir", "batch_size", "device", "num_threads")


@dataclass
class DataGenConfig:
    """Vanilla SPD rollouts on training prompts, with judge labels at their mismatches."""

    target: str = field(default="toy:target", metadata={"help": "target path, Hub id or toy:NAME"})
    drafter: str = field(
        default="toy:drafter_math", metadata={"help": "drafter path, Hub id or toy:NAME"}
    )
    task: str = field(
        default="math",
        metadata={"help": f"toy family ({', '.join(FAMILIES)}) or a benchmark with a grader "
                          f"({', '.join(BENCHMARK_TASKS)}; needs task_source)"},
    )
    task_source: str | None = field(
        default=None,
        metadata={"help": "local JSONL of training items for a benchmark task (upstream field "
                          "names); toy tasks draw their own problems"},
    )
    split: str = field(default="train", metadata={"help": "toy split drawn from (train or test)"})
    num_prompts: int = field(
        default=2000, metadata={"help": "prompts rolled out (benchmark tasks: the first N)"}
    )
    seed: int = field(
        default=0, metadata={"help": "toy problem draw and the per-rollout judge sample"}
    )
    num_draft_tokens: int = field(default=4, metadata={"help": "K: tokens drafted per round"})
    max_new_tokens: int = field(
        default=64, metadata={"help": "completion budget of a rollout and of every branch"}
    )
    stop_strings: list[str] = field(
        default_factory=list,
        metadata={"help": "finish a completion once its text contains one (benchmark tasks "
                          "add their own)"},
    )
    batch_size: int = field(
        default=64, metadata={"help": "rows decoded together (rollouts and draft branches)"}
    )
    judge: str = field(
        default="outcome",
        metadata={"help": "outcome (complete both branches and grade them) or model (a judge "
                          "LM scores each completed branch)"},
    )
    max_judged_per_rollout: int = field(
        default=16,
        metadata={"help": "judge at most this many mismatches per rollout, drawn with a "
                          "per-rollout seeded RNG (0: judge all)"},
    )
    weight_draft_only: float = field(
        default=1.0, metadata={"help": "draft branch right, target branch wrong: label 1"}
    )
    weight_target_only: float = field(
        default=1.0, metadata={"help": "draft branch wrong, target branch right: label 0"}
    )
    weight_both_correct: float = field(
        default=0.3, metadata={"help": "both right: label 1 (keeping the draft saves time)"}
    )
    weight_both_wrong: float = field(
        default=0.1, metadata={"help": "both wrong: label 0; 0 skips these mismatches"}
    )
    judge_model: str | None = field(
        default=None, metadata={"help": "model judge: the judge LM (default: the target)"}
    )
    judge_template: str = field(
        default="{prompt}{completion}\nIs this answer correct? ",
        metadata={"help": "model judge: text scored per branch ({prompt}, {completion})"},
    )
    judge_yes: str = field(
        default="yes", metadata={"help": "model judge: its first token means 'correct'"}
    )
    judge_no: str = field(
        default="no", metadata={"help": "model judge: its first token means 'wrong'"}
    )
    output_dir: str = field(
        default="runs/data_gen", metadata={"help": "shards, manifest.json and stats.json"}
    )
    shard_size: int = field(
        default=256, metadata={"help": "prompts per shard (the unit of resumption)"}
    )
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "sdpa or eager"})
    device: str = field(
        default="auto", metadata={"help": "auto (the process's accelerator, else cpu) or cpu"}
    )
    num_threads: int = field(
        default=0, metadata={"help": "torch CPU threads per process (0: torch's default)"}
    )

    def __post_init__(self) -> None:
        if self.task not in FAMILIES and self.task not in BENCHMARK_TASKS:
            raise CoSpecError(f"unknown task {self.task!r}; choose from "
                              f"{[*FAMILIES, *BENCHMARK_TASKS]}")
        if self.is_toy and self.task_source is not None:
            raise CoSpecError(f"toy task {self.task!r} draws its own problems; remove "
                              "task_source")
        if not self.is_toy and self.task_source is None:
            raise CoSpecError(f"task {self.task!r} needs task_source (a local JSONL of "
                              "training items; benchmark test sets are for evaluation)")
        if self.split not in ("train", "test"):
            raise CoSpecError(f"unknown split {self.split!r}; choose 'train' or 'test'")
        if self.judge not in JUDGES:
            raise CoSpecError(f"unknown judge {self.judge!r}; choose from {list(JUDGES)}")
        for name in ("num_prompts", "num_draft_tokens", "max_new_tokens", "batch_size",
                     "shard_size"):
            if getattr(self, name) < 1:
                raise CoSpecError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_judged_per_rollout < 0:
            raise CoSpecError(f"max_judged_per_rollout must be >= 0 (0: all), got "
                              f"{self.max_judged_per_rollout}")
        if self.num_threads < 0:
            raise CoSpecError(f"num_threads must be >= 0, got {self.num_threads}")
        for name, value in self.weights.items():
            if value < 0:
                raise CoSpecError(f"weight_{name} must be >= 0, got {value}")
        for name in ("weight_draft_only", "weight_target_only", "weight_both_correct"):
            if getattr(self, name) == 0:
                raise CoSpecError(f"{name} must be > 0 (only both-wrong mismatches can be "
                                  "skipped)")
        if self.device not in ("auto", "cpu"):
            raise CoSpecError(f"device must be auto or cpu, got {self.device!r}")

    @property
    def is_toy(self) -> bool:
        return self.task in FAMILIES

    @property
    def weights(self) -> dict[str, float]:
        """Training weight per outcome; a zero weight skips the outcome."""
        return {"draft_only": self.weight_draft_only, "target_only": self.weight_target_only,
                "both_correct": self.weight_both_correct, "both_wrong": self.weight_both_wrong}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Hash of the settings that decide the rows (see ``RESUMABLE_FIELDS``)."""
        settings = {k: v for k, v in self.to_dict().items() if k not in RESUMABLE_FIELDS}
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def parse_config(argv: list[str] | None = None) -> DataGenConfig:
    """``--config file.yaml`` plus ``--field value`` overrides, through ``trl.TrlParser``."""
    from trl import TrlParser

    parser = TrlParser(DataGenConfig, prog="cospec data-gen",
                       description=DataGenConfig.__doc__)
    try:
        (config,) = parser.parse_args_and_config(argv)
    except FileNotFoundError as err:
        raise CoSpecError(f"data-gen config {err.filename!r} does not exist") from err
    except ValueError as err:  # unknown YAML keys, malformed YAML mappings
        raise CoSpecError(str(err).splitlines()[0]) from err
    return config
