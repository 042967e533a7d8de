"""Stage 0 recipe: vanilla SPD rollouts on training prompts, judge labels at mismatches.

Run ``cospec data-gen --config configs/data_gen/toy.yaml`` (or ``python -m data_gen``), and
under ``accelerate launch`` for data parallelism. Read top to bottom:

1. setup: prompts, shards, the output directory (a rerun resumes it), models, judge;
2. loop over this process's unfinished shards: roll out, pick the mismatches to judge,
   judge them, write the shard's rows and record;
3. after every process is done, the main process writes the manifest and the statistics.

Shard ``i`` holds prompts ``[i * shard_size, (i + 1) * shard_size)`` and belongs to process
``i % num_processes``; its rows depend only on its prompts and the settings, so any number
of processes, and any number of interruptions, give the same dataset.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from cospec.engine import Engine, EngineConfig
from cospec.errors import CoSpecError
from cospec.models import check_same_vocabulary, load_model, load_tokenizer
from data_gen.config import DataGenConfig, parse_config
from data_gen.dataset import (
    CONFIG_FILE,
    STATS_FILE,
    completed_shards,
    merge_counts,
    remove_temporaries,
    shard_stem,
    write_json,
    write_manifest,
    write_shard,
)
from data_gen.judges import (
    OUTCOMES,
    Judge,
    JudgeCost,
    ModelJudge,
    OutcomeJudge,
    label_of,
    outcome_of,
)
from data_gen.rollouts import Rollout, run_rollouts, select_judged
from data_gen.tasks import TaskItem, load_task_items, task_stop_strings


def run_data_gen(config: DataGenConfig, console: Console | None = None) -> dict[str, Any]:
    """Generate (or finish) the dataset in ``config.output_dir``; returns the run's stats."""
    state = _process_state(config)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    items = load_task_items(config.task, config.task_source, config.split,
                            config.num_prompts, config.seed)
    num_shards = math.ceil(len(items) / config.shard_size)
    output_dir = Path(config.output_dir)
    fingerprint = config.fingerprint()
    _check_output_dir(output_dir, config)
    if state.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        remove_temporaries(output_dir)
        if not (output_dir / CONFIG_FILE).is_file():
            write_json(output_dir / CONFIG_FILE, config.to_dict())
    state.wait_for_everyone()

    done = completed_shards(output_dir, num_shards, fingerprint)
    mine = [i for i in range(num_shards)
            if i % state.num_processes == state.process_index and i not in done]
    if state.is_main_process and done:
        print(f"resuming {output_dir}: {len(done)} of {num_shards} shards already done")
    if mine:
        engine, judge = _setup_models(config, state)
        spans = {i: (i * config.shard_size, min(len(items), (i + 1) * config.shard_size))
                 for i in mine}
        bar = tqdm(total=sum(end - start for start, end in spans.values()), unit="prompt",
                   desc=f"data-gen [{state.process_index}]", disable=not state.is_main_process)
        for index in mine:
            start, end = spans[index]
            rows, counts = generate_shard(config, engine, judge, items[start:end], start)
            record = {"shard": index, "file": f"{shard_stem(index)}.parquet",
                      "prompts": [start, end], "process": state.process_index,
                      "fingerprint": fingerprint, "counts": counts}
            write_shard(output_dir, index, rows, record)
            if state.is_main_process:
                done = completed_shards(output_dir, num_shards, fingerprint)
                write_manifest(output_dir, config.to_dict(), fingerprint, num_shards, done)
            bar.update(end - start)
        bar.close()

    state.wait_for_everyone()
    done = completed_shards(output_dir, num_shards, fingerprint)
    stats = summarize(merge_counts(r["counts"] for r in done.values()))
    if state.is_main_process:
        write_manifest(output_dir, config.to_dict(), fingerprint, num_shards, done)
        write_json(output_dir / STATS_FILE, stats)
        print_stats(stats, console)
        print(f"wrote {len(done)} shards, {stats['rollouts']} rollouts to {output_dir} "
              "(load with data_gen.load_data_gen)")
    state.wait_for_everyone()
    return stats


def generate_shard(
    config: DataGenConfig, engine: Engine, judge: Judge, items: list[TaskItem], first: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Roll out, judge and label one shard's prompts; its rows and counts."""
    rollouts, rollout_tokens, rollout_seconds = run_rollouts(
        engine, items, range(first, first + len(items)), config.task)
    found, unreached, judged = [], [], []
    for rollout in rollouts:
        mismatches, missed = rollout.mismatches()
        picks = select_judged(rollout.rollout_id, len(mismatches),
                              config.max_judged_per_rollout, config.seed)
        found.append(mismatches)
        unreached.append(missed)
        judged.append([mismatches[i] for i in picks])
    before = JudgeCost(**asdict(judge.cost))
    judgements = judge.judge(rollouts, judged)
    counts = _empty_counts()
    counts["cost"] = {
        "rollout_tokens": rollout_tokens, "rollout_seconds": rollout_seconds,
        "branch_tokens": judge.cost.branch_tokens - before.branch_tokens,
        "judge_scored_tokens": judge.cost.scored_tokens - before.scored_tokens,
        "judge_seconds": judge.cost.seconds - before.seconds,
    }
    rows = []
    for rollout, mismatches, missed, picked, judgement in zip(
            rollouts, found, unreached, judged, judgements, strict=True):
        kind = counts["by_kind"].setdefault(rollout.item.kind, _kind_counts())
        row_mismatches = []
        for mismatch, draft_correct in zip(picked, judgement.draft_branch_correct, strict=True):
            outcome = outcome_of(draft_correct, judgement.target_branch_correct)
            counts["outcomes"][outcome] += 1
            kind["outcomes"][outcome] += 1
            weight = config.weights[outcome]
            if weight == 0:
                continue
            label = label_of(outcome)
            counts["labels"]["accept" if label else "reject"] += 1
            row_mismatches.append({
                "round_index": mismatch.round_index,
                "context_length": mismatch.context_length,
                "draft_tokens": list(mismatch.draft_tokens),
                "target_tokens": list(mismatch.target_tokens),
                "position": mismatch.position,
                "draft_prob": mismatch.draft_prob,
                "target_prob": mismatch.target_prob,
                "label": label,
                "weight": weight,
                "outcome": outcome,
                "draft_branch_correct": draft_correct,
            })
        for part in (counts, kind):
            part["rollouts"] += 1
            part["target_correct"] += int(judgement.target_branch_correct)
            part["mismatches"] += len(mismatches)
            part["judged"] += len(picked)
        counts["unreached"] += missed
        counts["written"] += len(row_mismatches)
        rows.append(_row(rollout, judgement.target_branch_correct, row_mismatches))
    return rows, counts


def _row(rollout: Rollout, target_correct: bool, mismatches: list[dict]) -> dict[str, Any]:
    return {
        "rollout_id": rollout.rollout_id,
        "prompt_index": rollout.prompt_index,
        "family": rollout.item.family,
        "kind": rollout.item.kind,
        "sequence_ids": rollout.sequence_ids,
        "prompt_length": len(rollout.prompt_ids),
        "completion": rollout.text,
        "target_branch_correct": target_correct,
        "mismatches": mismatches,
    }


def _kind_counts() -> dict[str, Any]:
    return {"rollouts": 0, "target_correct": 0, "mismatches": 0, "judged": 0,
            "outcomes": dict.fromkeys(OUTCOMES, 0)}


def _empty_counts() -> dict[str, Any]:
    return {**_kind_counts(), "unreached": 0, "written": 0,
            "labels": {"accept": 0, "reject": 0}, "by_kind": {}}


# ---- setup --------------------------------------------------------------------------------


def _process_state(config: DataGenConfig) -> PartialState:
    """This process's rank; CPU processes (no accelerator, or asked for) talk over gloo."""
    use_cpu = (config.device == "cpu" or not torch.cuda.is_available()
               or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"))
    state = PartialState(cpu=use_cpu)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != state.num_processes:
        raise CoSpecError(f"{launched} processes were launched but accelerate sees "
                          f"{state.num_processes}; launch with `accelerate launch`")
    return state


def _check_output_dir(output_dir: Path, config: DataGenConfig) -> None:
    """A rerun must have the settings of the run it resumes (batch size etc. may change)."""
    path = output_dir / CONFIG_FILE
    if not path.is_file():
        return
    try:
        saved = DataGenConfig(**json.loads(path.read_text()))
    except (TypeError, ValueError, CoSpecError) as err:
        raise CoSpecError(f"{path} is not a data-gen config of this version ({err}); use a "
                          "new output_dir") from err
    if saved.fingerprint() != config.fingerprint():
        changed = sorted(k for k, v in config.to_dict().items()
                         if saved.to_dict().get(k) != v)
        raise CoSpecError(f"{str(output_dir)!r} holds a run with other settings (changed: "
                          f"{', '.join(changed)}); use a new output_dir")


def _setup_models(config: DataGenConfig, state: PartialState) -> tuple[Engine, Judge]:
    device = torch.device("cpu") if state.device.type == "cpu" else state.device
    tokenizer = load_tokenizer(config.target)
    check_same_vocabulary(tokenizer, load_tokenizer(config.drafter), config.drafter)

    def load(name: str):
        return load_model(name, dtype=config.dtype, device=device,
                          attn_implementation=config.attn_implementation)

    target = load(config.target)
    engine = Engine(target, tokenizer, [load(config.drafter)], EngineConfig(
        method="spd", num_draft_tokens=config.num_draft_tokens,
        max_new_tokens=config.max_new_tokens,
        stop_strings=task_stop_strings(config.task, config.stop_strings),
        batch_size=config.batch_size, seed=config.seed, dtype=config.dtype,
        attn_implementation=config.attn_implementation,
    ))
    if config.judge == "outcome":
        return engine, OutcomeJudge(engine)
    judge_name = config.judge_model or config.target
    same = judge_name == config.target
    return engine, ModelJudge(
        engine, target if same else load(judge_name),
        tokenizer if same else load_tokenizer(judge_name), template=config.judge_template,
        yes=config.judge_yes, no=config.judge_no, batch_size=config.batch_size,
    )


# ---- statistics ---------------------------------------------------------------------------


def summarize(counts: dict[str, Any]) -> dict[str, Any]:
    """Counts plus the shares a reader wants: drafter-better share, target accuracy."""
    stats = {**_empty_counts(), **counts}
    stats.setdefault("cost", {})
    for part in [stats, *stats["by_kind"].values()]:
        part["drafter_better_share"] = (part["outcomes"]["draft_only"] / part["judged"]
                                        if part["judged"] else None)
        part["target_accuracy"] = (part["target_correct"] / part["rollouts"]
                                   if part["rollouts"] else None)
    stats["by_kind"] = dict(sorted(stats["by_kind"].items()))
    return stats


def print_stats(stats: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    table = Table(title="data-gen: judged mismatches of vanilla SPD rollouts")
    columns = ["kind", "rollouts", "target acc", "mismatches", "judged", *OUTCOMES,
               "drafter better"]
    for name in columns:
        table.add_column(name, justify="left" if name == "kind" else "right")

    def cells(name: str, part: dict[str, Any]) -> list[str]:
        share = part["drafter_better_share"]
        accuracy = part["target_accuracy"]
        return [name, str(part["rollouts"]), "-" if accuracy is None else f"{accuracy:.3f}",
                str(part["mismatches"]), str(part["judged"]),
                *(str(part["outcomes"][o]) for o in OUTCOMES),
                "-" if share is None else f"{share:.3f}"]

    for kind, part in stats["by_kind"].items():
        table.add_row(*cells(kind, part))
    table.add_row(*cells("all", stats), style="bold")
    console.print(table)
    cost = stats["cost"]
    console.print(
        f"labels: {stats['labels']['accept']} accept, {stats['labels']['reject']} reject "
        f"({stats['written']} written, {stats['judged'] - stats['written']} skipped, "
        f"{stats['unreached']} unreached mismatches); rollouts: "
        f"{cost.get('rollout_tokens', 0)} tokens in {cost.get('rollout_seconds', 0):.1f} s; "
        f"judge: {cost.get('branch_tokens', 0)} draft-branch tokens, "
        f"{cost.get('judge_scored_tokens', 0)} judge-LM tokens, "
        f"{cost.get('judge_seconds', 0):.1f} s"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Entry point of ``cospec data-gen``; bad input raises :class:`CoSpecError`."""
    return run_data_gen(parse_config(argv))
