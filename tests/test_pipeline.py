"""The main job end to end on a micro budget: every stage runs, the report fills every
method's row, and a rerun skips the completed stages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cospec.errors import CoSpecError
from cospec.pipeline import PipelineConfig, run_pipeline

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = REPO_ROOT / "configs"


def micro_config(tmp_path: Path) -> Path:
    config = {
        "name": "micro",
        "runs_dir": str(tmp_path / "runs"),
        "data_gen": str(CONFIGS / "data_gen" / "toy.yaml"),
        "sft": str(CONFIGS / "sft" / "toy.yaml"),
        "grpo": str(CONFIGS / "grpo" / "toy.yaml"),
        "eval": str(CONFIGS / "eval" / "pipeline_toy.yaml"),
        "dimr": {"model": "toy:target", "skip_ratio": 0.125, "n_trials": 3,
                 "n_startup_trials": 2, "calibration_prompts": 4,
                 "calibration_max_new_tokens": 16, "prompts_family": "math"},
        "overrides": {
            "data_gen": {"num_prompts": 80, "shard_size": 40},
            "sft": {"max_steps": 8, "eval_steps": 4, "save_steps": 4, "logging_steps": 2},
            "grpo": {"max_steps": 1, "prompts_per_step": 2, "num_generations": 2,
                     "save_steps": 1, "num_train_prompts": 16},
            "eval": {"limit": 6},
        },
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_micro_pipeline_end_to_end_then_skips_complete_stages(tmp_path, capsys):
    config = PipelineConfig.from_yaml(micro_config(tmp_path))
    summary = run_pipeline(config)
    run = tmp_path / "runs" / "micro"
    methods = summary["eval"]["methods"]
    assert set(methods) == {"target", "drafter", "spd", "metasd", "viasd", "cospec_sft",
                            "cospec_grpo", "cospec_grpo_metasd_viasd"}
    for row in methods.values():
        assert row["num_samples"] == 6 and row["tokens_per_second"] > 0
        assert row["accuracy"] is not None and row["speedup"] is not None
    report = (run / "report.md").read_text()
    assert all(f"| {name} |" in report for name in methods)
    assert json.loads((run / "pipeline.json").read_text())["sft"]["steps"] == 8
    for stage in ("data_gen", "sft", "grpo", "dimr", "eval"):
        assert (run / stage / ".complete").is_file()
    capsys.readouterr()
    run_pipeline(config)
    assert capsys.readouterr().out.count("skipped") == 5


def test_pipeline_config_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nstages: [a]\n")
    with pytest.raises(CoSpecError, match="unknown pipeline config key"):
        PipelineConfig.from_yaml(path)
    path.write_text("overrides: {training: {}}\n")
    with pytest.raises(CoSpecError, match="unknown stage"):
        PipelineConfig.from_yaml(path)
    with pytest.raises(CoSpecError, match="does not exist"):
        PipelineConfig.from_yaml(tmp_path / "missing.yaml")
