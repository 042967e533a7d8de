"""Stage 0 data generation: labels against a brute-force judge, resumption, data parallelism.

The reference for the outcome judge is independent of the engine: each branch is
re-derived with a plain greedy loop over the target (full forward per token, no cache, no
drafter) and graded with the toy grader.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cospec.engine import Engine, EngineConfig
from cospec.errors import CoSpecError
from cospec.models import load_model, load_tokenizer
from cospec.toy import tasks
from data_gen import (
    DataGenConfig,
    ModelJudge,
    label_of,
    load_data_gen,
    outcome_of,
    parse_config,
    read_manifest,
    run_data_gen,
)
from data_gen.rollouts import _cut_at_stop, _finished, run_rollouts, select_judged
from data_gen.tasks import load_task_items

REPO_ROOT = Path(__file__).resolve().parents[1]
SMALL = {"task": "math", "num_prompts": 48, "shard_size": 4, "batch_size": 4,
         "max_new_tokens": 48, "num_threads": 1, "seed": 0}


def small_config(output_dir: Path, **overrides) -> DataGenConfig:
    return DataGenConfig(**{**SMALL, "output_dir": str(output_dir), **overrides})


def cli_args(output_dir: Path) -> list[str]:
    args = [f"--{key}={value}" for key, value in SMALL.items()]
    return [*args, f"--output_dir={output_dir}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted single-process run of the small config."""
    output_dir = tmp_path_factory.mktemp("data_gen") / "reference"
    run_data_gen(small_config(output_dir))
    return output_dir


@pytest.fixture(scope="module")
def toy_models():
    torch.set_num_threads(1)
    return load_model("toy:target"), load_model("toy:drafter_math"), load_tokenizer("toy:target")


def test_outcome_and_label_table():
    # SPEC 3.1: draft right & target wrong -> accept; draft wrong & target right -> reject.
    assert outcome_of(True, False) == "draft_only" and label_of("draft_only") == 1
    assert outcome_of(False, True) == "target_only" and label_of("target_only") == 0
    assert outcome_of(True, True) == "both_correct" and label_of("both_correct") == 1
    assert outcome_of(False, False) == "both_wrong" and label_of("both_wrong") == 0


def test_judged_sample_is_capped_and_reproducible():
    picks = select_judged("math-7", 20, 5, seed=0)
    assert picks == sorted(picks) and len(set(picks)) == 5
    assert picks == select_judged("math-7", 20, 5, seed=0)
    assert picks != select_judged("math-8", 20, 5, seed=0)  # a different draw per rollout
    assert select_judged("math-7", 3, 5, seed=0) == [0, 1, 2]
    assert select_judged("math-7", 20, 0, seed=0) == list(range(20))  # 0: judge all


def test_draft_branch_stops_where_a_fresh_run_would(tokenizer):
    """A stop string straddling the branch prefix and its continuation still ends it."""
    engine = SimpleNamespace(config=SimpleNamespace(stop_strings=["\n#"], max_new_tokens=20),
                             tokenizer=tokenizer, eos_token_id=tokenizer.eos_token_id)
    ids = tokenizer(" 1+2=3\n### 3", add_special_tokens=False).input_ids
    head = len(" 1+2=3\n")  # the prefix ends with "\n", the continuation starts with "#"
    assert tokenizer.decode(_cut_at_stop(ids, head, engine)) == " 1+2=3\n#"
    assert _finished(ids[:head + 1], engine) and not _finished(ids[:head], engine)
    assert _finished([*ids[:3], tokenizer.eos_token_id], engine)  # d_j is the end


def _greedy(model, ids: list[int], budget: int, eos: int) -> list[int]:
    """Plain greedy decoding: one full forward per token, stop after eos or the budget."""
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < budget:
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
            if out[-1] == eos:
                break
    return out


def test_outcome_judge_labels_match_brute_force(reference, toy_models):
    target, _, tokenizer = toy_models
    config = small_config(reference)
    problems = tasks.generate("math", "train", config.num_prompts, config.seed)
    rows = load_data_gen(reference).to_list()
    assert [r["prompt_index"] for r in rows] == list(range(config.num_prompts))
    judged = [(row, m) for row in rows for m in row["mismatches"]]
    accepts = [x for x in judged if x[1]["label"] == 1]
    rejects = [x for x in judged if x[1]["label"] == 0]
    assert accepts and rejects, "the small run should label both classes"
    eos = tokenizer.eos_token_id
    for row, m in accepts[:4] + rejects[:4]:
        problem = problems[row["prompt_index"]]
        prompt_length = row["prompt_length"]
        # Target branch: the rollout is the target's own greedy completion.
        completion = _greedy(target, row["sequence_ids"][:prompt_length],
                             config.max_new_tokens, eos)
        assert row["sequence_ids"][prompt_length:] == completion
        target_correct = tasks.grade(problem, tokenizer.decode(completion,
                                                               skip_special_tokens=True))
        assert row["target_branch_correct"] == target_correct
        # The mismatch: the block agreed before position j and the rollout emitted t_j.
        start, j = m["context_length"], m["position"]
        assert m["draft_tokens"][:j] == row["sequence_ids"][start:start + j]
        assert m["target_tokens"][j] == row["sequence_ids"][start + j] != m["draft_tokens"][j]
        # Draft branch: keep d_j, then greedy within the rollout's budget.
        head = row["sequence_ids"][prompt_length:start] + m["draft_tokens"][:j + 1]
        tail = [] if head[-1] == eos else _greedy(
            target, row["sequence_ids"][:prompt_length] + head,
            config.max_new_tokens - len(head), eos)
        draft_correct = tasks.grade(problem, tokenizer.decode(head + tail,
                                                              skip_special_tokens=True))
        outcome = outcome_of(draft_correct, target_correct)
        assert (m["draft_branch_correct"], m["outcome"]) == (draft_correct, outcome)
        assert (m["label"], m["weight"]) == (label_of(outcome), config.weights[outcome])


def test_stats_and_manifest_are_complete(reference):
    manifest = read_manifest(reference)
    stats = json.loads((reference / "stats.json").read_text())
    rows = load_data_gen(reference).to_list()
    assert manifest["complete"] and len(manifest["shards"]) == 12
    assert stats["rollouts"] == len(rows) == 48
    assert stats["judged"] == sum(stats["outcomes"].values())
    written = [m for r in rows for m in r["mismatches"]]
    assert stats["written"] == len(written) == sum(stats["labels"].values())
    assert stats["outcomes"]["draft_only"] == sum(m["outcome"] == "draft_only" for m in written)
    assert stats["target_correct"] == sum(r["target_branch_correct"] for r in rows)
    assert set(stats["by_kind"]) == {r["kind"] for r in rows}
    assert stats["cost"]["branch_tokens"] > 0


def test_both_wrong_weight_zero_skips(tmp_path, reference):
    skipped = run_data_gen(small_config(tmp_path / "skip", weight_both_wrong=0.0))
    full = json.loads((reference / "stats.json").read_text())
    assert skipped["outcomes"] == full["outcomes"]
    assert skipped["written"] == full["written"] - full["outcomes"]["both_wrong"]
    rows = load_data_gen(tmp_path / "skip").to_list()
    assert all(m["outcome"] != "both_wrong" for r in rows for m in r["mismatches"])


def test_kill_then_resume_equals_uninterrupted(tmp_path, reference):
    output_dir = tmp_path / "killed"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "data_gen", *cli_args(output_dir)],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    manifest = output_dir / "manifest.json"
    deadline = time.monotonic() + 120
    while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not read_manifest(output_dir)["complete"], "killed too late to test resumption"
    first = output_dir / "shard-00000.parquet"
    written_at = first.stat().st_mtime_ns
    # Leftovers of a kill at the worst moments: a temporary file, a shard without a record.
    (output_dir / "shard-00011.parquet.tmp-1").write_bytes(b"partial")
    (output_dir / "shard-00011.parquet").write_bytes(b"not parquet")

    run_data_gen(small_config(output_dir))
    assert first.stat().st_mtime_ns == written_at  # completed shards are not redone
    assert not list(output_dir.glob("*.tmp-*"))
    assert load_data_gen(output_dir).to_list() == load_data_gen(reference).to_list()
    stats = json.loads((output_dir / "stats.json").read_text())
    reference_stats = json.loads((reference / "stats.json").read_text())
    assert {k: v for k, v in stats.items() if k != "cost"} == {
        k: v for k, v in reference_stats.items() if k != "cost"}


def test_resume_with_other_settings_is_refused(tmp_path, reference):
    with pytest.raises(CoSpecError, match=r"other settings.*num_draft_tokens"):
        run_data_gen(small_config(reference, num_draft_tokens=3))
    with pytest.raises(CoSpecError, match="holds 0 of"):
        (tmp_path / "manifest.json").write_text(json.dumps(
            {"complete": False, "shards": [], "num_shards": 3}))
        load_data_gen(tmp_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_write_disjoint_shards_with_the_same_union(tmp_path, reference):
    output_dir = tmp_path / "two"
    env = os.environ | {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(REPO_ROOT / "configs" / "accelerate" / "cpu_2proc.yaml"), "--main_process_port",
         str(_free_port()), "-m", "data_gen", *cli_args(output_dir)],
        cwd=REPO_ROOT, env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    shards = read_manifest(output_dir)["shards"]
    assert [s["process"] for s in shards] == [i % 2 for i in range(12)]
    assert load_data_gen(output_dir).to_list() == load_data_gen(reference).to_list()


def test_config_from_yaml_with_overrides(tmp_path):
    path = tmp_path / "dg.yaml"
    path.write_text("task: string\nnum_prompts: 7\nweight_both_wrong: 0.0\n")
    config = parse_config(["--config", str(path), "--num_prompts", "9"])
    assert (config.task, config.num_prompts, config.weight_both_wrong) == ("string", 9, 0.0)
    toy = parse_config(["--config", str(REPO_ROOT / "configs" / "data_gen" / "toy.yaml")])
    assert (toy.target, toy.drafter, toy.task) == ("toy:target", "toy:drafter_math", "math")
    path.write_text("tsk: string\n")
    with pytest.raises(CoSpecError, match="tsk"):
        parse_config(["--config", str(path)])
    with pytest.raises(CoSpecError, match="unknown judge"):
        DataGenConfig(judge="vibes")
    with pytest.raises(CoSpecError, match="needs task_source"):
        DataGenConfig(task="gsm8k")


def test_model_judge_interface(toy_models, tiny_llama, tokenizer):
    target, drafter, toy_tokenizer = toy_models
    engine = Engine(target, toy_tokenizer, [drafter],
                    EngineConfig(num_draft_tokens=4, max_new_tokens=48, batch_size=8))
    config = small_config(Path("unused"), num_prompts=6)
    items = load_task_items(config.task, config.task_source, config.split, 6, config.seed)
    rollouts, _, _ = run_rollouts(engine, items, range(6), "math")
    mismatches = [r.mismatches()[0] for r in rollouts]
    judge_lm = tiny_llama(seed=3)
    judge = ModelJudge(engine, judge_lm, tokenizer, yes="yes", no="no", batch_size=4)
    judgements = judge.judge(rollouts, mismatches)
    assert len(judgements) == len(rollouts)
    assert [len(j.draft_branch_correct) for j in judgements] == [len(m) for m in mismatches]
    assert judge.cost.scored_tokens > 0
    # Batched (left-padded) scores equal one-text-at-a-time scores.
    texts = [judge._text(r, r.text) for r in rollouts]
    batched = judge.score(texts)
    single = [judge.score([t])[0] for t in texts]
    assert torch.allclose(torch.tensor(batched), torch.tensor(single), atol=1e-5)
    assert [j.target_branch_correct for j in judgements] == [s >= 0.5 for s in batched]
    with pytest.raises(CoSpecError, match="same token"):
        ModelJudge(engine, judge_lm, tokenizer, yes="yes", no="yup")
