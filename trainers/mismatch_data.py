"""Stage 0's judged mismatches as stage 1 training examples.

Stage 0 (``data_gen``) writes one row per rollout: the final ``sequence_ids`` and a list of
judged ``mismatches`` (context_length, the round's draft and target blocks, the mismatch
position j, label, weight, ...). One training example is one rollout: all its judged rounds
are packed into one arbiter forward (:func:`cospec.arbiter.pack_rollouts`), and the loss
reads the head's logit at each round's position j.

The held-out split is a seeded hash of ``rollout_id``: stable across runs, processes and
dataset order, and a rollout never moves between train and held-out when the dataset
grows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, load_dataset, load_from_disk

from cospec.arbiter import ArbitratedRound, PackedBatch, pack_rollouts
from cospec.errors import CoSpecError
from data_gen.dataset import MANIFEST_FILE, load_data_gen

REQUIRED_COLUMNS = ("rollout_id", "sequence_ids", "mismatches")
MISMATCH_FIELDS = ("context_length", "draft_tokens", "target_tokens", "position", "label", "weight")


def load_rollouts(path: str | Path) -> Dataset:
    """Read stage 0's output directory with ``data_gen.load_data_gen``.

    Also reads a directory written by ``Dataset.save_to_disk``, or Parquet / JSONL shards
    of the same schema (datasets built by other means, tests).
    """
    directory = Path(path)
    if not directory.exists():
        raise CoSpecError(f"dataset path {str(path)!r} does not exist")
    if (directory / MANIFEST_FILE).is_file():
        dataset = load_data_gen(directory)
    elif (directory / "dataset_info.json").is_file() or (directory / "state.json").is_file():
        dataset = load_from_disk(str(directory))
    elif parquet := sorted(directory.rglob("*.parquet")):
        dataset = load_dataset("parquet", data_files=[str(p) for p in parquet], split="train")
    elif jsonl := sorted(directory.rglob("*.jsonl")):
        dataset = load_dataset("json", data_files=[str(p) for p in jsonl], split="train")
    else:
        raise CoSpecError(
            f"{str(path)!r} holds no rollouts: expected a data_gen output directory, a saved "
            "dataset, Parquet or JSONL files"
        )
    missing = [c for c in REQUIRED_COLUMNS if c not in dataset.column_names]
    if missing:
        raise CoSpecError(f"rollouts in {str(path)!r} lack the columns {missing}")
    return dataset


def is_held_out(rollout_id: str, eval_fraction: float, seed: int) -> bool:
    """Seeded hash split: the same answer on every rank, run and machine."""
    digest = hashlib.sha256(f"{seed}:{rollout_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def split_rollouts(
    dataset: Dataset, eval_fraction: float, seed: int
) -> tuple[list[int], list[int]]:
    """Row indices of the training and held-out rollouts.

    Rollouts without a judged mismatch of positive weight are dropped: they carry no
    signal (a "both branches wrong" mismatch may be kept by stage 0 with weight 0).
    """
    train, held_out = [], []
    columns = dataset.select_columns(["rollout_id", "mismatches"])
    for start in range(0, len(columns), 1024):
        chunk = columns[start : start + 1024]
        for offset, (rollout_id, mismatches) in enumerate(
            zip(chunk["rollout_id"], chunk["mismatches"], strict=True)
        ):
            if not any(m["weight"] > 0 for m in mismatches):
                continue
            index = start + offset
            (held_out if is_held_out(rollout_id, eval_fraction, seed) else train).append(index)
    return train, held_out


def infer_num_draft_tokens(dataset: Dataset, indices: Sequence[int]) -> int:
    """K, read from the first judged round (every round of a stage-0 run has K tokens)."""
    for index in indices:
        for mismatch in dataset[int(index)]["mismatches"]:
            return len(mismatch["draft_tokens"])
    raise CoSpecError("the dataset has no judged mismatches to train on")


@dataclass
class MismatchBatch:
    """Packed rollouts plus, per round [B, N], the mismatch position, label and weight.

    Padded rounds have weight 0 and position 0.
    """

    packed: PackedBatch
    positions: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor

    def to(self, device: torch.device | str) -> MismatchBatch:
        return MismatchBatch(
            self.packed.to(device),
            self.positions.to(device),
            self.labels.to(device),
            self.weights.to(device),
        )


def collate_rollouts(
    rows: Mapping[str, Sequence[Any]], num_draft_tokens: int, pad_token_id: int
) -> MismatchBatch:
    """Build a batch from ``dataset[indices]`` (a dict of columns), keeping rounds of weight > 0."""
    rollouts, per_rollout = [], []
    for sequence_ids, mismatches in zip(rows["sequence_ids"], rows["mismatches"], strict=True):
        judged = [m for m in mismatches if m["weight"] > 0]
        for m in judged:
            if not 0 <= m["position"] < num_draft_tokens:
                raise CoSpecError(
                    f"mismatch position {m['position']} is outside the block of "
                    f"K={num_draft_tokens} tokens"
                )
        rounds = [
            ArbitratedRound(
                m["context_length"],
                torch.as_tensor(m["draft_tokens"], dtype=torch.long),
                torch.as_tensor(m["target_tokens"], dtype=torch.long),
            )
            for m in judged
        ]
        rollouts.append((torch.as_tensor(sequence_ids, dtype=torch.long), rounds))
        per_rollout.append(judged)
    packed = pack_rollouts(rollouts, num_draft_tokens, pad_token_id)
    shape = packed.round_mask.shape
    positions = torch.zeros(shape, dtype=torch.long)
    labels = torch.zeros(shape, dtype=torch.float32)
    weights = torch.zeros(shape, dtype=torch.float32)
    for row, judged in enumerate(per_rollout):
        for index, m in enumerate(judged):
            positions[row, index] = m["position"]
            labels[row, index] = float(m["label"])
            weights[row, index] = float(m["weight"])
    return MismatchBatch(packed, positions, labels, weights)
