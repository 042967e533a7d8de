"""Held-out metrics for the arbiter and the run's metrics log (shared by the SFT and GRPO recipes).

The arbiter is a binary classifier at mismatches (accept the draft token or not), so
held-out quality is measured as one: ROC AUC (ranking), accuracy at 0.5, expected
calibration error (are the probabilities honest?) and the weighted binary cross-entropy
that stage 1 minimises. AUC, accuracy and ECE count every judged mismatch once; the BCE
uses the judge's weights, so it is the training objective on held-out data.

:class:`MetricsLog` appends one JSON object per logged event to ``metrics.jsonl`` as the
run goes, forwards it to the configured tracker (TensorBoard, W&B) and redraws the loss
curve PNG.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"
LOSS_CURVE_FILE = "loss_curve.png"


def roc_auc(scores: Sequence[float], labels: Sequence[int]) -> float:
    """Exact ROC AUC by the Mann-Whitney U statistic; tied scores count one half.

    AUC = P(score of a random positive > score of a random negative) + 0.5 * P(tie).
    NaN when either class is absent.
    """
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    num_pos = int(labels.sum())
    num_neg = len(labels) - num_pos
    if num_pos == 0 or num_neg == 0:
        return math.nan
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores), dtype=np.float64)
    # Average 1-based rank over each run of equal scores.
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [len(scores)]])
    for start, end in zip(starts, ends, strict=True):
        ranks[order[start:end]] = (start + 1 + end) / 2
    u = ranks[labels].sum() - num_pos * (num_pos + 1) / 2
    return float(u / (num_pos * num_neg))


def expected_calibration_error(
    probs: Sequence[float], labels: Sequence[int], num_bins: int = 10
) -> float:
    """ECE over ``num_bins`` equal-width bins of P(accept): sum_b (n_b / n) |mean p - mean y|."""
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.float64)
    if len(probs) == 0:
        return math.nan
    bins = np.minimum((probs * num_bins).astype(np.int64), num_bins - 1)
    error = 0.0
    for b in range(num_bins):
        in_bin = bins == b
        if in_bin.any():
            error += in_bin.mean() * abs(probs[in_bin].mean() - labels[in_bin].mean())
    return float(error)


def binary_metrics(
    logits: Sequence[float], labels: Sequence[int], weights: Sequence[float]
) -> dict[str, float]:
    """AUC, accuracy at 0.5, ECE (10 bins), weighted BCE and counts for accept logits."""
    logits = np.asarray(logits, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    probs = 1.0 / (1.0 + np.exp(-logits))
    # log(1 + exp(-|x|)) form: stable for large logits.
    bce = np.maximum(logits, 0) - logits * labels + np.log1p(np.exp(-np.abs(logits)))
    return {
        "auc": roc_auc(probs, labels),
        "accuracy": float(((probs >= 0.5) == (labels == 1)).mean()) if len(labels) else math.nan,
        "ece": expected_calibration_error(probs, labels),
        "bce": float((weights * bce).sum() / weights.sum()) if weights.sum() > 0 else math.nan,
        "accept_rate": float((probs >= 0.5).mean()) if len(labels) else math.nan,
        "positive_rate": float(labels.mean()) if len(labels) else math.nan,
        "num_mismatches": len(labels),
    }


class MetricsLog:
    """``metrics.jsonl`` + tracker + loss curve, written by the main process only.

    Each record is ``{"step": ..., "split": "train" | "eval", ...}``. On resume the file is
    cut back to the records of steps up to the checkpoint, so the log reads like one run.
    """

    def __init__(self, output_dir: str | Path, accelerator: Any, *, resume_step: int = 0):
        self.path = Path(output_dir) / METRICS_FILE
        self.curve_path = Path(output_dir) / LOSS_CURVE_FILE
        self.accelerator = accelerator
        self.records: list[dict[str, Any]] = []
        if not accelerator.is_main_process:
            return
        if resume_step and self.path.is_file():
            kept = [json.loads(line) for line in self.path.read_text().splitlines() if line]
            self.records = [r for r in kept if r["step"] <= resume_step]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))

    def log(self, split: str, step: int, values: Mapping[str, Any]) -> None:
        record = {"step": step, "split": split, **values}
        self.accelerator.log({f"{split}/{k}": v for k, v in values.items()
                              if isinstance(v, int | float)}, step=step)
        if not self.accelerator.is_main_process:
            return
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def plot(self) -> None:
        if self.accelerator.is_main_process:
            plot_loss_curve(self.records, self.curve_path)


def plot_loss_curve(records: Sequence[Mapping[str, Any]], path: str | Path) -> None:
    """Training loss and held-out BCE against optimizer steps; held-out AUC on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if r["split"] == "train"]
    held_out = [r for r in records if r["split"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train weighted BCE", color="tab:blue")
    if held_out:
        ax.plot([r["step"] for r in held_out], [r["bce"] for r in held_out], "o-",
                label="held-out weighted BCE", color="tab:orange")
        auc_ax = ax.twinx()
        auc_ax.plot([r["step"] for r in held_out], [r["auc"] for r in held_out], "s--",
                    label="held-out AUC", color="tab:green")
        auc_ax.set_ylabel("AUC")
        auc_ax.set_ylim(0.0, 1.0)
        auc_ax.legend(loc="upper right")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("weighted BCE")
    ax.set_title("Arbiter supervised warm-up")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
