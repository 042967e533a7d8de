"""The CoSpec arbiter: decides, at a mismatch, whether to keep the draft token.

The engine uses :meth:`ArbiterModel.score_round` once per round; training uses
:func:`pack_rollouts` and :meth:`ArbiterModel.score_packed_batch`; :func:`push_to_hub`
publishes a saved arbiter.
"""

from cospec.arbiter.hub import push_to_hub
from cospec.arbiter.masks import attention_mask_for, hybrid_mask
from cospec.arbiter.model import ArbiterConfig, ArbiterModel
from cospec.arbiter.packing import ArbitratedRound, PackedBatch, pack_rollouts

__all__ = [
    "ArbiterConfig",
    "ArbiterModel",
    "ArbitratedRound",
    "PackedBatch",
    "attention_mask_for",
    "hybrid_mask",
    "pack_rollouts",
    "push_to_hub",
]
