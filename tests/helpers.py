"""Shared test helpers: prompts, noisy drafters and brute-force references.

Brute force means no cache and no batching: a full forward over the whole sequence at
every step, the independent reference the engine is compared with.
"""

from __future__ import annotations

import copy
import weakref

import torch

PROMPTS = [
    "Q: Tom has 3 apples.\nA:",
    "Q: Hi\nA:",
    "Q: Reverse the word cat, please, and then more.\nA:",
    "Q: x\nA:",
    "Q: Ann has 12 pens. She gives away 5.\nA:",
    "Q: Join the first letters of sun map cup.\nA:",
    "Q: Capitalize the word dog.\nA:",
    "Q: 7+5=\nA:",
]


def noisy_copy(model, scale: float, seed: int):
    """A drafter that agrees with the target often but not always: ragged acceptance."""
    torch.manual_seed(seed)
    drafter = copy.deepcopy(model)
    with torch.no_grad():
        for param in drafter.parameters():
            param.add_(scale * torch.randn_like(param) * param.std())
    return drafter


_REFERENCE_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reference_greedy(model, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """Brute-force greedy, memoised per live model (keys die with the model)."""
    cache = _REFERENCE_CACHE.setdefault(model, {})
    key = (tuple(ids), max_new_tokens, eos)
    if key not in cache:
        cache[key] = brute_force_greedy(model, ids, max_new_tokens, eos)
    return cache[key]


def brute_force_greedy(model, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """Target-only greedy with a full forward over the whole sequence at every step."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
            if out[-1] == eos:
                break
    return out


def first_token_histograms(result, positions: int, vocab: int) -> torch.Tensor:
    tokens = torch.tensor([s.token_ids[:positions] for s in result.sequences])
    return torch.stack([torch.bincount(tokens[:, j], minlength=vocab).float() / len(tokens)
                        for j in range(positions)])
