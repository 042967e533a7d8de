"""The batch's shared column layout and the models' KV caches over it.

Every row of a batch lives in the same columns. A round appends K draft columns to every
row and then one column for the target's token; drafts a row rejected become *holes*:
columns masked out of attention forever. Rows therefore never roll back a cache: a
rejected draft is simply never attended again. Explicit position ids keep each row's
positions contiguous over its valid tokens. When holes make up too much of the layout, the
fully consumed prefix is compacted (valid tokens packed to the right, left padding), and
every cache is gathered the same way.

Each model keeps its own cache over a prefix of the columns (``seen``). Whatever it has
not seen yet it consumes at its next forward: that single mechanism is the lazy catch-up
for drafters that sat out rounds, for the target after rounds it did not verify, and for
any other model attached to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel


@dataclass
class Layout:
    """Token ids, validity and position ids of every column, for every row."""

    tokens: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    next_position: torch.Tensor
    tentative: int = 0

    @classmethod
    def from_prompts(cls, prompts: list[list[int]], pad_id: int, device: torch.device) -> Layout:
        """Left-pad the prompts into one layout."""
        width = max(map(len, prompts))
        tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        valid = torch.zeros((len(prompts), width), dtype=torch.bool)
        for i, ids in enumerate(prompts):
            tokens[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            valid[i, width - len(ids):] = True
        positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
        lengths = valid.sum(-1)
        return cls(tokens.to(device), valid.to(device), positions.to(device), lengths.to(device))

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def append(self, columns: torch.Tensor) -> None:
        """Append tentative (valid) columns at the next positions; ``commit`` settles them."""
        n = columns.shape[1]
        offsets = torch.arange(self.tentative, self.tentative + n, device=columns.device)
        self.tentative += n
        self.tokens = torch.cat([self.tokens, columns], dim=1)
        self.valid = torch.cat([self.valid, torch.ones_like(columns, dtype=torch.bool)], dim=1)
        self.positions = torch.cat([self.positions, self.next_position[:, None] + offsets], dim=1)

    def commit(self, num_drafted: int, accepted: torch.Tensor, next_token: torch.Tensor) -> None:
        """Turn rejected draft columns into holes and append the target's token column."""
        if num_drafted:
            kept = torch.arange(num_drafted, device=accepted.device) < accepted[:, None]
            self.valid[:, self.width - num_drafted:] = kept
        self.next_position = self.next_position + accepted
        self.tentative = 0
        self.append(next_token[:, None])
        self.next_position = self.next_position + 1
        self.tentative = 0

    def select_rows(self, rows: torch.Tensor) -> None:
        self.tokens, self.valid = self.tokens[rows], self.valid[rows]
        self.positions, self.next_position = self.positions[rows], self.next_position[rows]

    def compaction_plan(self, prefix: int) -> torch.Tensor:
        """Per-row gather index that packs the valid columns of ``[0, prefix)`` to the right.

        A stable sort puts holes first and valid columns after them in their original
        order; keeping the last ``max valid`` entries of each row left-pads the shorter rows.
        """
        order = torch.sort(self.valid[:, :prefix].int(), dim=1, stable=True).indices
        kept = int(self.valid[:, :prefix].sum(-1).max())
        return order[:, prefix - kept:]

    def compact(self, prefix: int, gather: torch.Tensor) -> None:
        def pack(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x[:, :prefix].gather(1, gather), x[:, prefix:]], dim=1)

        self.tokens, self.valid, self.positions = map(pack, (self.tokens, self.valid,
                                                             self.positions))


class CachedModel:
    """A model, its KV cache, and how many layout columns the cache covers (``seen``).

    This is the one small interface the decode loop uses for caches; a preallocated static
    cache can implement the same four operations (forward, select rows, compact) later.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.seen = 0
        self.calls = 0

    def forward_new(self, layout: Layout, logits_to_keep: int) -> torch.Tensor:
        """Consume every column not seen yet; return logits of the last ``logits_to_keep``."""
        out = self.model(
            input_ids=layout.tokens[:, self.seen:],
            attention_mask=layout.valid.long(),
            position_ids=layout.positions[:, self.seen:],
            cache=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        self.seen = layout.width
        self.calls += 1
        return out.logits

    def _layers(self):
        return [layer for layer in self.cache.layers
                if getattr(layer, "is_initialized", False) and layer.keys is not None]

    def select_rows(self, rows: torch.Tensor) -> None:
        for layer in self._layers():
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]

    def compact(self, prefix: int, gather: torch.Tensor) -> None:
        """Apply the layout's compaction to the cached keys and values."""
        for layer in self._layers():
            layer.keys = _pack_columns(layer.keys, prefix, gather)
            layer.values = _pack_columns(layer.values, prefix, gather)
        self.seen = self.seen - prefix + gather.shape[1]


def _pack_columns(states: torch.Tensor, prefix: int, gather: torch.Tensor) -> torch.Tensor:
    """Gather the first ``prefix`` columns of [B, heads, columns, dim] states per row."""
    index = gather[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[-1])
    return torch.cat([states[:, :, :prefix].gather(2, index), states[:, :, prefix:]], dim=2)
