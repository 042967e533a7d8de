"""Attention masks for the arbiter's hybrid layout: a causal context plus bidirectional regions.

Every arbiter forward uses one column layout::

    [context columns 0..C) [region 0] [region 1] ... [region N-1]      (each region: R columns)

The context is causal and may contain columns that must never be attended (left padding,
holes left by rejected tokens): a 2D validity mask says which. Region n is one round's
``[d_1..d_K][t_1..t_K]`` (R = 2K): it sees the valid context columns before its own
context length and every column of itself, in both directions, and nothing else. The
queries are always the last Q columns of the layout, so the same builder serves a cached
round (queries = the new context columns + the region) and a packed training forward
(queries = everything).

Masks are built as booleans (True = attend) and converted to what the attention
implementation expects only at the model boundary: sdpa takes the boolean mask, eager
needs an additive float mask (it adds the mask to the scores, so a boolean mask there would
silently add 0/1 instead of masking).
"""

from __future__ import annotations

import torch

from cospec.errors import CoSpecError
from cospec.models import ATTN_IMPLEMENTATIONS


def check_attn_implementation(attn_implementation: str) -> None:
    """Refuse attention backends that cannot take a custom 4D mask (FlashAttention, flex)."""
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise CoSpecError(
            f"the arbiter needs custom attention masks, which {attn_implementation!r} attention "
            f"cannot express; load the drafter with one of {list(ATTN_IMPLEMENTATIONS)}"
        )


def hybrid_mask(
    context_mask: torch.Tensor,
    region_context_lengths: torch.Tensor,
    region_length: int,
    num_queries: int | None = None,
) -> torch.Tensor:
    """Boolean mask [B, 1, Q, C + N * region_length] for the layout described in the module.

    Args:
        context_mask: [B, C], true where a context column holds a real token.
        region_context_lengths: [B, N], how many leading context columns region n of each row
            may see (a region of length 0 sees only itself, which is how padded rounds of a
            packed batch are neutralised).
        region_length: columns per region (2K).
        num_queries: the last Q columns are the queries; all columns when omitted.

    Every query also attends to itself. For real tokens that is already implied; for a
    padding or hole query it is the only key, which keeps its row of the softmax finite
    (an all-masked row gives NaN under sdpa, and NaN values poison later layers even
    through zero attention weights).
    """
    batch_size, num_context = context_mask.shape
    num_regions = region_context_lengths.shape[1]
    total = num_context + num_regions * region_length
    num_queries = total if num_queries is None else num_queries
    device = context_mask.device

    columns = torch.arange(total, device=device)
    is_context = columns < num_context
    # -1 for context columns, else the region index.
    region_of = torch.where(
        is_context, -1, (columns - num_context).div(region_length, rounding_mode="floor")
    )
    query_columns = columns[total - num_queries :]
    query_region = region_of[query_columns]
    query_is_context = query_region < 0

    # How many leading context columns each query may see: causal for context queries,
    # the round's context length for region queries.
    if num_regions:
        region_limits = region_context_lengths.to(device).gather(
            1, query_region.clamp(min=0).expand(batch_size, -1)
        )
    else:
        region_limits = torch.zeros(batch_size, num_queries, dtype=torch.long, device=device)
    limits = torch.where(query_is_context, query_columns + 1, region_limits)  # [B, Q]

    key_valid = torch.zeros(batch_size, total, dtype=torch.bool, device=device)
    key_valid[:, :num_context] = context_mask.bool()
    sees_context = key_valid[:, None, :] & (columns[None, None, :] < limits[:, :, None])
    same_region = (query_region[:, None] == region_of[None, :]) & ~query_is_context[:, None]
    itself = query_columns[:, None] == columns[None, :]
    return (sees_context | same_region | itself)[:, None]


def attention_mask_for(
    mask: torch.Tensor, attn_implementation: str, dtype: torch.dtype
) -> torch.Tensor:
    """Convert a boolean mask to the form ``attn_implementation`` expects (see module doc)."""
    check_attn_implementation(attn_implementation)
    if attn_implementation == "sdpa":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, torch.finfo(dtype).min
    )
