"""Packing a rollout's arbitrated rounds into one forward pass (training).

A rollout's rounds all saw prefixes of the same final committed sequence, and a causal
prefix's hidden states do not depend on what follows it. So one forward over
``[final sequence] [region of round 0] [region of round 1] ...`` computes every round's
context once and every region against exactly the prefix that round saw: the same numbers
as one forward per round, for the cost of one.

Batches of rollouts are right-padded to one layout: sequences to the longest sequence,
round lists to the longest list (a padded round sees only itself and is flagged off in
``round_mask``), so the region offsets are the same in every row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cospec.arbiter.masks import hybrid_mask
from cospec.errors import CoSpecError


@dataclass(frozen=True)
class ArbitratedRound:
    """One round as the arbiter saw it.

    ``context_length`` is the number of committed tokens (prompt included) before the
    round's block, i.e. the prefix of the final sequence that the round's context was.
    """

    context_length: int
    draft_tokens: torch.Tensor  # [K]
    target_tokens: torch.Tensor  # [K]


@dataclass
class PackedBatch:
    """Model inputs for rollouts packed by :func:`pack_rollouts`.

    Columns are ``[sequences, right-padded to S] [N regions of 2K columns]``; ``mask`` is the
    boolean hybrid mask [B, 1, T, T] (True = attend); ``round_mask`` [B, N] is true for real
    rounds.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    round_mask: torch.Tensor

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.mask.to(device),
            self.round_mask.to(device),
        )


def pack_rollouts(
    rollouts: Sequence[tuple[torch.Tensor, Sequence[ArbitratedRound]]],
    num_draft_tokens: int,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Collate ``(final sequence ids [S_i], arbitrated rounds)`` pairs into one batch.

    Region tokens of a round with context length c take positions ``c + j`` (draft and
    target alike), exactly as in a per-round forward.
    """
    k = num_draft_tokens
    region_length = 2 * k
    seq_len = max(len(sequence) for sequence, _ in rollouts)
    num_rounds = max(len(rounds) for _, rounds in rollouts)
    total = seq_len + num_rounds * region_length
    batch_size = len(rollouts)

    input_ids = torch.full((batch_size, total), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros(batch_size, total, dtype=torch.long)
    context_mask = torch.zeros(batch_size, seq_len, dtype=torch.bool)
    context_lengths = torch.zeros(batch_size, num_rounds, dtype=torch.long)
    round_mask = torch.zeros(batch_size, num_rounds, dtype=torch.bool)
    block_positions = torch.arange(k).repeat(2)

    for row, (sequence, rounds) in enumerate(rollouts):
        length = len(sequence)
        input_ids[row, :length] = torch.as_tensor(sequence)
        position_ids[row, :length] = torch.arange(length)
        context_mask[row, :length] = True
        for index, round_ in enumerate(rounds):
            _check_round(round_, k, length, row, index)
            start = seq_len + index * region_length
            input_ids[row, start : start + k] = torch.as_tensor(round_.draft_tokens)
            input_ids[row, start + k : start + region_length] = torch.as_tensor(
                round_.target_tokens
            )
            position_ids[row, start : start + region_length] = (
                round_.context_length + block_positions
            )
            context_lengths[row, index] = round_.context_length
            round_mask[row, index] = True

    mask = hybrid_mask(context_mask, context_lengths, region_length)
    return PackedBatch(input_ids, position_ids, mask, round_mask)


def _check_round(round_: ArbitratedRound, k: int, length: int, row: int, index: int) -> None:
    where = f"round {index} of rollout {row}"
    if len(round_.draft_tokens) != k or len(round_.target_tokens) != k:
        raise CoSpecError(
            f"{where} has blocks of {len(round_.draft_tokens)} draft and "
            f"{len(round_.target_tokens)} target tokens; the arbiter uses K={k}"
        )
    if not 1 <= round_.context_length <= length:
        raise CoSpecError(
            f"{where} has context length {round_.context_length}, outside the final "
            f"sequence of {length} tokens"
        )
