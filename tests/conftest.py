"""Shared fixtures: the toy tokenizer and tiny randomly initialised stock HF models.

Random models are the right reference for engine correctness (exactness does not depend on
training); tests that need trained behaviour use the shipped toy world (``toy:NAME``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from cospec.toy.tokenizer import build_tokenizer

# Tiny models are dominated by per-op overhead: one thread is faster than two, and on a
# shared 2-core machine extra threads spin against other work.
torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


def make_tiny_llama(
    vocab_size: int,
    num_layers: int = 2,
    hidden_size: int = 32,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """A random fp32 Llama small enough to run hundreds of forwards in a test."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config._attn_implementation = attn_implementation
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_llama(tokenizer) -> Callable[..., PreTrainedModel]:
    """Factory: ``tiny_llama(num_layers=..., hidden_size=..., seed=...)``."""

    def factory(**kwargs) -> PreTrainedModel:
        return make_tiny_llama(len(tokenizer), **kwargs)

    return factory
