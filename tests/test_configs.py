"""Every shipped YAML config parses into its stage's config class (no model is loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
from trl import ModelConfig, TrlParser

from data_gen.config import parse_config
from eval.harness import EvalConfig
from trainers.grpo import GRPOConfig
from trainers.sft import SFTConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("**/data_gen*.yaml"))
                         + sorted((CONFIGS / "data_gen").glob("*.yaml")), ids=str)
def test_data_gen_configs(path):
    parse_config(["--config", str(path)])


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("real/*/sft.yaml"))
                         + sorted((CONFIGS / "sft").glob("*.yaml")), ids=str)
def test_sft_configs(path):
    TrlParser((SFTConfig, ModelConfig)).parse_args_and_config(["--config", str(path)])


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("real/*/grpo.yaml"))
                         + sorted((CONFIGS / "grpo").glob("*.yaml")), ids=str)
def test_grpo_configs(path):
    TrlParser((GRPOConfig,)).parse_args_and_config(["--config", str(path)])


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("real/*/eval.yaml"))
                         + [p for p in sorted((CONFIGS / "eval").glob("*.yaml"))
                            if p.name != "pipeline_toy.yaml"], ids=str)
def test_eval_configs(path):
    EvalConfig.from_yaml(path)
