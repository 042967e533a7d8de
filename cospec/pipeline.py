"""``cospec pipeline``: the whole method on one config, stage by stage.

data-gen (stage 0) -> SFT (stage 1) -> GRPO (stage 2) -> DIMR (slim-verifier mask) ->
evaluation of every method on the same held-out prompts -> a report under
``runs/<name>/``. Each stage writes into its own directory and marks it complete when it
returns; a rerun skips complete stages, and an interrupted stage resumes through its own
checkpoints (every stage is resumable on its own). The stages are the same entry points
a user runs by hand (``cospec data-gen``, ``cospec sft``, ...), with paths wired here.
"""

from __future__ import annotations

import argparse
import json
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from cospec.errors import CoSpecError

DEFAULT_CONFIG = "configs/pipeline/toy.yaml"
COMPLETE = ".complete"


@dataclass
class PipelineConfig:
    """Where each stage's config lives and how the run is named; overrides per stage."""

    name: str = field(default="toy", metadata={"help": "run name: outputs go to runs/<name>"})
    runs_dir: str = field(default="runs", metadata={"help": "parent directory of runs"})
    data_gen: str = field(default="configs/data_gen/toy.yaml",
                          metadata={"help": "stage-0 config"})
    sft: str = field(default="configs/sft/toy.yaml", metadata={"help": "stage-1 config"})
    grpo: str = field(default="configs/grpo/toy.yaml", metadata={"help": "stage-2 config"})
    eval: str = field(default="configs/eval/pipeline_toy.yaml",
                      metadata={"help": "eval config; ${sft_arbiter}, ${grpo_arbiter} and "
                                        "${slim_mask} in it are filled with this run's paths"})
    dimr: dict[str, Any] = field(default_factory=dict,
                                 metadata={"help": "cospec dimr flags (name: value)"})
    overrides: dict[str, dict[str, Any]] = field(
        default_factory=dict,
        metadata={"help": "per-stage field overrides: {data_gen: {...}, sft: {...}, ...}"},
    )

    @classmethod
    def from_yaml(cls, path: str | Path) -> PipelineConfig:
        path = Path(path)
        if not path.is_file():
            raise CoSpecError(f"pipeline config {str(path)!r} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CoSpecError(f"unknown pipeline config key(s) {unknown}; known: {sorted(known)}")
        stages = {"data_gen", "sft", "grpo", "eval"}
        bad = sorted(set(data.get("overrides", {})) - stages)
        if bad:
            raise CoSpecError(f"overrides for unknown stage(s) {bad}; stages: {sorted(stages)}")
        return cls(**data)

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.name


def _flags(values: dict[str, Any], dashes: bool = False) -> list[str]:
    """``{key: value}`` as command-line flags (lists repeat nothing: YAML-style values)."""
    out = []
    for key, value in values.items():
        flag = "--" + (key.replace("_", "-") if dashes else key)
        out += [flag, json.dumps(value) if isinstance(value, (list, dict)) else str(value)]
    return out


def _stage(console: Console, name: str, directory: Path, run: Callable[[], Any]) -> None:
    """Run a stage unless its directory is marked complete; mark it when it returns."""
    marker = directory / COMPLETE
    if marker.is_file():
        console.print(f"[bold]{name}[/]: complete in {directory}, skipped")
        return
    console.rule(f"{name} -> {directory}")
    start = time.perf_counter()
    run()
    directory.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"seconds": time.perf_counter() - start}))


def run_pipeline(config: PipelineConfig, console: Console | None = None) -> dict[str, Any]:
    from cospec import dimr_cli
    from data_gen.main import main as data_gen_main
    from eval.harness import EvalConfig, run_eval
    from trainers import grpo, sft

    console = console or Console()
    run = config.run_dir
    dirs = {s: run / s for s in ("data_gen", "sft", "grpo", "dimr", "eval")}
    paths = {"sft_arbiter": str(dirs["sft"] / "arbiter"),
             "grpo_arbiter": str(dirs["grpo"] / "arbiter"),
             "slim_mask": str(dirs["dimr"] / "mask.json")}
    over = config.overrides

    _stage(console, "stage 0: data-gen", dirs["data_gen"], lambda: data_gen_main(
        ["--config", config.data_gen, "--output_dir", str(dirs["data_gen"]),
         *_flags(over.get("data_gen", {}))]))
    _stage(console, "stage 1: SFT", dirs["sft"], lambda: sft.main(
        ["--config", config.sft, "--output_dir", str(dirs["sft"]),
         "--dataset_path", str(dirs["data_gen"]), *_flags(over.get("sft", {}))]))
    _stage(console, "stage 2: GRPO", dirs["grpo"], lambda: grpo.main(
        ["--config", config.grpo, "--output_dir", str(dirs["grpo"]),
         "--sft_arbiter", paths["sft_arbiter"], *_flags(over.get("grpo", {}))]))
    _stage(console, "DIMR: slim-verifier mask", dirs["dimr"], lambda: dimr_cli.main(
        ["--output-dir", str(dirs["dimr"]), *_flags(config.dimr, dashes=True)]))

    def evaluate() -> None:
        text = Path(config.eval).read_text() if Path(config.eval).is_file() else None
        if text is None:
            raise CoSpecError(f"eval config {config.eval!r} does not exist")
        data = yaml.safe_load(string.Template(text).substitute(paths))
        data.update({"output_dir": str(dirs["eval"])} | over.get("eval", {}))
        run_eval(EvalConfig.from_dict(data))

    _stage(console, "evaluation", dirs["eval"], evaluate)
    summary = write_report(run, dirs)
    console.print(f"report: {run / 'report.md'}")
    return summary


def write_report(run: Path, dirs: dict[str, Path]) -> dict[str, Any]:
    """One readable page and one JSON with every stage's headline numbers."""
    from eval.report import markdown_table

    def read(path: Path) -> Any:
        return json.loads(path.read_text()) if path.is_file() else None

    evaluation = read(dirs["eval"] / "summary.json")
    summary = {
        "data_gen": read(dirs["data_gen"] / "stats.json"),
        "sft": read(dirs["sft"] / "training_summary.json"),
        "grpo": _last_metrics(dirs["grpo"] / "metrics.jsonl"),
        "dimr": read(dirs["dimr"] / "report.json"),
        "eval": evaluation,
    }
    (run / "pipeline.json").write_text(json.dumps(summary, indent=2))
    lines = [f"# CoSpec pipeline: {run.name}", ""]
    if evaluation:
        lines += ["## Held-out evaluation (same prompts, one run)", "",
                  markdown_table(evaluation), "",
                  "![accuracy vs speedup](eval/accuracy_vs_speedup.png)",
                  "![acceptance by position](eval/acceptance_by_position.png)", ""]
    if summary["data_gen"]:
        stats = summary["data_gen"]
        lines += ["## Stage 0: judged mismatches", "",
                  f"{stats.get('judged')} judged mismatches; labels {stats.get('labels')}", ""]
    if summary["sft"]:
        lines += ["## Stage 1: SFT held-out metrics", "", "```",
                  json.dumps(summary["sft"], indent=1), "```",
                  "![loss curve](sft/loss_curve.png)", ""]
    if summary["grpo"]:
        lines += ["## Stage 2: GRPO (last step)", "", "```",
                  json.dumps(summary["grpo"], indent=1), "```",
                  "![reward curve](grpo/reward_curve.png)", ""]
    if summary["dimr"]:
        lines += ["## DIMR slim-verifier mask", "", "```",
                  json.dumps(summary["dimr"], indent=1), "```", ""]
    (run / "report.md").write_text("\n".join(lines))
    return summary


def _last_metrics(path: Path) -> dict[str, Any] | None:
    rows = [line for line in path.read_text().splitlines() if line] if path.is_file() else []
    return json.loads(rows[-1]) if rows else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="cospec pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="pipeline YAML")
    args = parser.parse_args(argv)
    return run_pipeline(PipelineConfig.from_yaml(args.config))
