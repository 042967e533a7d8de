"""Losses of the arbiter's training stages, as plain functions of tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mismatch_logits(logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each round's logit at its mismatch: ``logits`` [B, N, K], ``positions`` [B, N] -> [B, N]."""
    return logits.gather(-1, positions.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def weighted_bce_sum(
    logits: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Stage 1 loss, unnormalised: sum over rounds of ``weight * BCE(logit at mismatch, label)``.

    ``logits`` [B, N, K] from :meth:`ArbiterModel.score_packed_batch`; ``positions``,
    ``labels`` and ``weights`` are [B, N]. Padded rounds carry weight 0, so they drop out.
    The caller divides by the sum of weights over the whole (global) batch, so that every
    judged mismatch counts the same however the batch is split across micro-batches and
    ranks.
    """
    selected = mismatch_logits(logits, positions).float()
    bce = F.binary_cross_entropy_with_logits(selected, labels.float(), reduction="none")
    return (bce * weights).sum()
