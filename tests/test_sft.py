"""Stage 1 recipe (trainers/sft.py): learning, exact resumption, DDP and DeepSpeed runs.

The data are synthetic rollouts in stage 0's schema where the label is learnable: a mismatch
is to be accepted iff its draft token is even. The arbiter sits on the shipped toy drafter.
References are independent of the recipe: brute-force pairwise AUC over a reloaded arbiter,
an uninterrupted run for resumption, a one-process run for the multi-process ones.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from itertools import product
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from datasets import Dataset
from safetensors.torch import load_file
from trl import ModelConfig, TrlParser

from cospec.arbiter import ArbiterModel, ArbitratedRound
from cospec.errors import CoSpecError
from trainers.checkpointing import resolve_resume_checkpoint
from trainers.distributed import BatchOrder, eval_batches
from trainers.metrics import binary_metrics, expected_calibration_error, roc_auc
from trainers.mismatch_data import is_held_out, split_rollouts
from trainers.sft import SFTConfig, main, train

REPO_ROOT = Path(__file__).resolve().parents[1]
K = 4
ARBITER_FILES = ("adapter_model.safetensors", "arbiter_head.safetensors")


def synthetic_rollouts(num_rollouts: int, seed: int = 0) -> Dataset:
    """Rollouts in stage 0's schema; label = 1 iff the draft token at the mismatch is even.

    Mismatch tokens come from a small pool so a few hundred steps suffice; every third
    round has weight 0 (a skipped "both wrong"), which the recipe must ignore.
    """
    rng = random.Random(seed)
    pool = list(range(20, 32))
    rows = []
    for i in range(num_rollouts):
        length = rng.randint(12, 28)
        sequence = [1] + [rng.randrange(3, 89) for _ in range(length - 1)]
        mismatches = []
        for r in range(rng.randint(1, 3)):
            draft = [rng.randrange(3, 89) for _ in range(K)]
            target = list(draft)
            j = rng.randrange(K)
            draft[j] = rng.choice(pool)
            target[j] = rng.choice([t for t in pool if t != draft[j]])
            label = int(draft[j] % 2 == 0)
            mismatches.append({
                "context_length": rng.randint(4, length), "draft_tokens": draft,
                "target_tokens": target, "position": j, "draft_prob": 0.3, "target_prob": 0.5,
                "label": label, "weight": 0.0 if r == 2 else rng.choice([1.0, 1.0, 0.3]),
                "outcome": "draft_only" if label else "target_only",
                "draft_branch_correct": bool(label),
            })
        rows.append({
            "rollout_id": f"synthetic-{seed}-{i}", "prompt_index": i, "family": "math",
            "kind": "synthetic", "sequence_ids": sequence, "prompt_length": 4,
            "target_branch_correct": not mismatches[0]["label"], "mismatches": mismatches,
        })
    return Dataset.from_list(rows)


@pytest.fixture(scope="module")
def rollouts_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rollouts") / "data"
    synthetic_rollouts(400).save_to_disk(str(path))
    return path


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each in-process run builds its own Accelerator; one torch thread (shared CPUs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.set_num_threads(threads)


def sft_args(rollouts_dir: Path, output_dir: Path, **overrides) -> list[str]:
    values = {
        "config": "configs/sft/toy.yaml", "dataset_path": rollouts_dir, "output_dir": output_dir,
        "learning_rate": 5e-3, "eval_fraction": 0.2, "logging_steps": 5, "eval_steps": 0,
        "save_steps": 0, **overrides,
    }
    return [arg for key, value in values.items() for arg in (f"--{key}", str(value))]


def parse(args: list[str]) -> tuple[SFTConfig, ModelConfig]:
    return TrlParser((SFTConfig, ModelConfig)).parse_args_and_config(args)


def arbiter_weights(directory: Path) -> dict[str, torch.Tensor]:
    weights = {}
    for name in ARBITER_FILES:
        weights |= {f"{name}:{k}": v for k, v in load_file(directory / name).items()}
    return weights


# ---- pieces ---------------------------------------------------------------------------------


def test_auc_matches_pairwise_count_with_ties():
    rng = random.Random(0)
    scores = [rng.choice([0.1, 0.2, 0.2, 0.5, 0.7, 0.9]) for _ in range(60)]
    labels = [rng.random() < 0.4 for _ in range(60)]
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    pairwise = sum((p > n) + 0.5 * (p == n) for p, n in product(pos, neg)) / (len(pos) * len(neg))
    assert roc_auc(scores, labels) == pytest.approx(pairwise, abs=1e-12)
    assert roc_auc([0.3, 0.3], [1, 0]) == 0.5


def test_ece_and_binary_metrics_by_hand():
    # Bin [0.2, 0.3): p = 0.2, 0.2, labels 0, 1 -> |0.2 - 0.5|; bin [0.9, 1]: p = 0.9, label 1.
    assert expected_calibration_error([0.2, 0.2, 0.9], [0, 1, 1]) == pytest.approx(
        2 / 3 * 0.3 + 1 / 3 * 0.1
    )
    metrics = binary_metrics([0.0, 2.0], [1, 0], [1.0, 3.0])
    expected_bce = (1 * torch.log(torch.tensor(2.0)) + 3 * (2 + torch.log1p(torch.exp(
        torch.tensor(-2.0))))) / 4
    assert metrics["bce"] == pytest.approx(expected_bce.item(), rel=1e-6)
    assert metrics["accuracy"] == 0.5 and metrics["auc"] == 0.0


def test_global_batch_is_the_same_however_it_is_split():
    splits = [(8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 1, 8), (2, 4, 1)]  # (batch, ranks, accum)
    steps = {}
    for b, world, accum in splits:
        order = BatchOrder(100, b, world, accum, seed=3)
        steps[(b, world, accum)] = [
            sorted(i for r in range(world) for mb in order.micro_batches(s, r) for i in mb)
            for s in range(order.steps_per_epoch * 2)
        ]
    reference = steps[(8, 1, 1)]
    assert all(s == reference for s in steps.values())
    epoch = [i for s in reference[:12] for i in s]
    assert len(set(epoch)) == 96  # 12 whole steps of 8; 4 examples dropped this epoch
    assert reference[12] != reference[0]  # a new permutation in the next epoch


def test_eval_batches_cover_every_example_once_with_equal_counts():
    for n, b, world in [(10, 3, 2), (1, 4, 2), (7, 2, 3)]:
        per_rank = [eval_batches(n, b, world, r) for r in range(world)]
        assert len({len(batches) for batches in per_rank}) == 1
        real = [i for batches in per_rank for idx, num in batches for i in idx[:num]]
        assert sorted(real) == list(range(n))


def test_split_is_a_stable_hash_and_drops_rollouts_without_weight():
    dataset = synthetic_rollouts(50)
    train_ids, eval_ids = split_rollouts(dataset, 0.3, seed=0)
    assert not set(train_ids) & set(eval_ids)
    assert eval_ids == [i for i in range(50) if is_held_out(dataset[i]["rollout_id"], 0.3, 0)]
    assert 5 < len(eval_ids) < 25
    shuffled = dataset.shuffle(seed=1)
    moved = {shuffled[i]["rollout_id"] for i in split_rollouts(shuffled, 0.3, 0)[1]}
    assert moved == {dataset[i]["rollout_id"] for i in eval_ids}
    zero = dataset.map(lambda row: {"mismatches": [
        {**m, "weight": 0.0} for m in row["mismatches"]]} if row["prompt_index"] == 0 else {})
    kept_train, kept_eval = split_rollouts(zero, 0.3, 0)
    assert 0 not in kept_train + kept_eval


def test_fresh_start_over_existing_checkpoints_is_refused(tmp_path):
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-9").mkdir()  # no trainer_state.json: cut short, not a checkpoint
    with pytest.raises(CoSpecError, match="already has checkpoints"):
        resolve_resume_checkpoint(tmp_path, None)
    assert resolve_resume_checkpoint(tmp_path, "true") == tmp_path / "checkpoint-4"
    assert resolve_resume_checkpoint(tmp_path / "empty", True) is None


# ---- recipe runs ----------------------------------------------------------------------------


def test_short_run_learns_and_saves_a_loadable_arbiter(rollouts_dir, tmp_path):
    """(a) 1 process: held-out AUC well above 0.5, recomputed from the reloaded arbiter."""
    out = tmp_path / "run"
    metrics = main(sft_args(rollouts_dir, out, max_steps=100, eval_steps=50,
                            per_device_train_batch_size=8))
    assert metrics["auc"] > 0.8, metrics
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "eval"] == [50, 100]
    assert (out / "loss_curve.png").stat().st_size > 0
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["held_out_auc"] == metrics["auc"]

    arbiter = ArbiterModel.load(out / "arbiter")
    dataset = synthetic_rollouts(400)
    _, eval_ids = split_rollouts(dataset, 0.2, seed=0)
    scores, labels = [], []
    with torch.no_grad():
        for i in eval_ids:
            row = dataset[i]
            judged = [m for m in row["mismatches"] if m["weight"] > 0]
            rounds = [ArbitratedRound(m["context_length"], torch.tensor(m["draft_tokens"]),
                                      torch.tensor(m["target_tokens"])) for m in judged]
            logits = arbiter.score_packed(torch.tensor(row["sequence_ids"]), rounds)
            scores += [logits[n, m["position"]].item() for n, m in enumerate(judged)]
            labels += [m["label"] for m in judged]
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    pairwise = sum((p > n) + 0.5 * (p == n) for p, n in product(pos, neg)) / (len(pos) * len(neg))
    assert pairwise == pytest.approx(metrics["auc"], abs=1e-3)
    assert len(scores) == metrics["num_mismatches"]


def test_resume_after_a_kill_matches_an_uninterrupted_run(rollouts_dir, tmp_path):
    """(b) Stop after step 5 (checkpoint at 3; step 4-5 work is lost), resume -> same weights."""
    common = {"max_steps": 8, "save_steps": 3, "logging_steps": 1, "eval_steps": 4,
              "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}
    main(sft_args(rollouts_dir, tmp_path / "whole", **common))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    config, model_config = parse(sft_args(rollouts_dir, tmp_path / "killed", **common))
    assert train(config, model_config, stop_after_step=5) is None
    assert not (tmp_path / "killed" / "arbiter").exists()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    main(sft_args(rollouts_dir, tmp_path / "killed", resume_from_checkpoint="true", **common))

    whole = arbiter_weights(tmp_path / "whole" / "arbiter")
    resumed = arbiter_weights(tmp_path / "killed" / "arbiter")
    assert whole.keys() == resumed.keys()
    for name in whole:
        assert torch.equal(whole[name], resumed[name]), name
    logs = [(tmp_path / d / "metrics.jsonl").read_text().splitlines() for d in ("whole", "killed")]
    strip = [[{k: v for k, v in json.loads(line).items() if k != "rollouts_per_second"}
              for line in lines] for lines in logs]
    assert strip[0] == strip[1]


def test_accumulation_matches_one_big_micro_batch(rollouts_dir, tmp_path):
    """Normalising by the global batch weight: 2 micro-batches of 2 = 1 of 4."""
    runs = {"big": {"per_device_train_batch_size": 4},
            "accumulated": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}}
    for name, overrides in runs.items():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        main(sft_args(rollouts_dir, tmp_path / name, max_steps=4, lora_dropout=0.0, **overrides))
    _assert_close_to(arbiter_weights(tmp_path / "big" / "arbiter"),
                     tmp_path / "accumulated" / "arbiter")
    # Same loss and the same pre-clipping gradient norm: the gradient scale is right too
    # (Adam alone would hide a wrong overall scale).
    _assert_same_training_log(train_log(tmp_path / "big"), tmp_path / "accumulated")


def _launch(accelerate_config: str, args: list[str], num_processes: int = 2) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env |= {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               accelerate_config, "--num_processes", str(num_processes),
               "--main_process_port", str(port), "-m", "trainers.sft", *args]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


@pytest.fixture(scope="module")
def one_process_reference(rollouts_dir, tmp_path_factory) -> dict:
    """10 steps of 4 rollouts on one process, no dropout: what 2 x 2 must reproduce."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    out = tmp_path_factory.mktemp("reference")
    main(sft_args(rollouts_dir, out, max_steps=10, lora_dropout=0.0,
                  per_device_train_batch_size=4))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return {"weights": arbiter_weights(out / "arbiter"), "log": train_log(out)}


def train_log(directory: Path) -> list[dict]:
    lines = (directory / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


def _assert_same_training_log(reference: list[dict], directory: Path) -> None:
    records = train_log(directory)
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for got, want in zip(records, reference, strict=True):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert got[key] == pytest.approx(want[key], rel=1e-4), (key, got, want)


def _assert_close_to(reference: dict[str, torch.Tensor], directory: Path) -> None:
    weights = arbiter_weights(directory)
    assert weights.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(weights[name], reference[name], atol=1e-4, rtol=1e-3)


@pytest.mark.slow
def test_two_process_ddp_matches_one_process(rollouts_dir, tmp_path, one_process_reference):
    """(c) 2 CPU processes over gloo, 2 rollouts each = 1 process with 4."""
    out = tmp_path / "ddp"
    _launch("configs/accelerate/cpu_2proc.yaml", sft_args(
        rollouts_dir, out, max_steps=10, lora_dropout=0.0, per_device_train_batch_size=2))
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["processes"] == 2 and summary["replicas_in_sync"] is True
    _assert_close_to(one_process_reference["weights"], out / "arbiter")
    _assert_same_training_log(one_process_reference["log"], out)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_two_process_deepspeed_on_cpu(rollouts_dir, tmp_path, one_process_reference, stage):
    """(d) DeepSpeed ZeRO-2/3 on CPU (gloo): completes, checkpoints, saves a loadable arbiter."""
    out = tmp_path / stage
    _launch(f"configs/accelerate/{stage}.yaml", sft_args(
        rollouts_dir, out, max_steps=10, save_steps=5, lora_dropout=0.0,
        per_device_train_batch_size=2))
    assert (out / "checkpoint-10" / "trainer_state.json").is_file()
    assert json.loads((out / "training_summary.json").read_text())["processes"] == 2
    ArbiterModel.load(out / "arbiter")
    _assert_close_to(one_process_reference["weights"], out / "arbiter")
    _assert_same_training_log(one_process_reference["log"], out)


def test_push_to_hub_gets_the_saved_arbiter_and_summary(rollouts_dir, tmp_path, monkeypatch):
    pushed = {}

    def fake_push(arbiter_dir, repo_id, *, private, training_summary):
        pushed.update(dir=Path(arbiter_dir), repo=repo_id, private=private,
                      summary=training_summary)
        return f"https://huggingface.co/{repo_id}"

    monkeypatch.setattr("trainers.sft.push_to_hub", fake_push)
    out = tmp_path / "run"
    main(sft_args(rollouts_dir, out, max_steps=2, push_to_hub="true", hub_model_id="me/arbiter"))
    assert pushed["dir"] == out / "arbiter" and pushed["repo"] == "me/arbiter"
    assert pushed["private"] is True and pushed["summary"]["steps"] == 2
    with pytest.raises(CoSpecError, match="hub_model_id"):
        parse(sft_args(rollouts_dir, out, push_to_hub="true"))
