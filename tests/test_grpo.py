"""The GRPO recipe end to end on the toy world (tiny budgets)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cospec.arbiter import ArbiterModel
from cospec.models import load_model
from trainers.grpo import GRPOConfig, train

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stage1_arbiter(tmp_path_factory):
    """A stage-1 stand-in: a fresh arbiter whose head accepts about half the mismatches."""
    directory = tmp_path_factory.mktemp("sft") / "arbiter"
    torch.manual_seed(0)
    arbiter = ArbiterModel.from_drafter(load_model("toy:drafter_math"), num_draft_tokens=4,
                                        base_model="toy:drafter_math")
    with torch.no_grad():
        arbiter.head.weight.normal_(0, 0.05)
        arbiter.head.bias.zero_()
    arbiter.save_pretrained(directory)
    return directory


def small_config(tmp_path, stage1, **overrides) -> GRPOConfig:
    values = dict(sft_arbiter=str(stage1), output_dir=str(tmp_path / "grpo"),
                  num_train_prompts=32, prompts_per_step=2, num_generations=4,
                  max_completion_length=32, max_steps=2, save_steps=1, learning_rate=1e-3)
    return GRPOConfig(**(values | overrides))


def test_grpo_steps_change_the_policy_and_write_outputs(tmp_path, stage1_arbiter):
    config = small_config(tmp_path, stage1_arbiter)
    metrics = train(config)
    out = tmp_path / "grpo"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward_mean", "accuracy", "rho", "kl", "clip_fraction", "entropy",
                "mean_accepted_length", "rollout_tokens_per_s"):
        assert key in metrics
    trained = ArbiterModel.load(out / "arbiter", load_model("toy:drafter_math"))
    start = ArbiterModel.load(stage1_arbiter, load_model("toy:drafter_math"))
    assert not torch.equal(trained.head.weight, start.head.weight)
    assert (out / "reward_curve.png").is_file()


def test_resume_continues_without_redoing_steps(tmp_path, stage1_arbiter):
    train(small_config(tmp_path, stage1_arbiter, max_steps=1))
    train(small_config(tmp_path, stage1_arbiter, max_steps=2))
    resumed = ArbiterModel.load(tmp_path / "grpo" / "arbiter", load_model("toy:drafter_math"))
    rows = (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2]
    straight_dir = tmp_path / "straight"
    train(small_config(straight_dir, stage1_arbiter, max_steps=2))
    straight = ArbiterModel.load(straight_dir / "grpo" / "arbiter",
                                 load_model("toy:drafter_math"))
    assert torch.allclose(resumed.head.weight, straight.head.weight, atol=1e-6)


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_launch(command: list[str], env: dict[str, str]) -> None:
    """accelerate launch on a free loopback port; a failure shows the job's stderr."""
    command = [*command[:3], "--main_process_port", free_port(), *command[3:]]
    done = subprocess.run(command, env=os.environ | env, timeout=600, capture_output=True,
                          text=True, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


def launch_config(tmp_path, stage1) -> Path:
    config = tmp_path / "grpo.yaml"
    config.write_text("\n".join([
        f"sft_arbiter: {stage1}", f"output_dir: {tmp_path / 'out'}",
        "num_train_prompts: 32", "prompts_per_step: 2", "num_generations: 4",
        "max_completion_length: 32", "max_steps: 2", "save_steps: 2", "learning_rate: 0.001",
    ]))
    return config


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_two_processes_complete(tmp_path, stage1_arbiter, stage):
    """ZeRO-3 shards the arbiter; rollouts gather it, and the target is loaded whole."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(REPO_ROOT / "configs" / "accelerate" / f"{stage}.yaml"), "--num_processes", "2",
              "-m", "trainers.grpo", "--config",
              str(launch_config(tmp_path, stage1_arbiter))]
    run_launch(launch, {"OMP_NUM_THREADS": "1"})
    replicas = json.loads((tmp_path / "out" / "replicas.json").read_text())
    assert replicas["processes"] == 2
    ArbiterModel.load(tmp_path / "out" / "arbiter", load_model("toy:drafter_math"))


@pytest.mark.slow
def test_two_processes_stay_in_sync(tmp_path, stage1_arbiter):
    config = launch_config(tmp_path, stage1_arbiter)
    env = {"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(REPO_ROOT / "configs" / "accelerate" / "cpu_2proc.yaml"), "-m",
              "trainers.grpo", "--config", str(config)]
    run_launch(launch, env)
    replicas = json.loads((tmp_path / "out" / "replicas.json").read_text())
    assert replicas == {"processes": 2, "replicas_in_sync": True}
