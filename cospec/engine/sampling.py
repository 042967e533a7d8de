"""Acceptance rules as pure tensor functions (no Python loop over tokens).

Shapes: ``draft`` [B, K] drafted ids, ``p`` [B, K, V] drafter distributions, ``q``
[B, K+1, V] target distributions, where ``q[:, j]`` is conditioned on ``draft[:, :j]``.
Each rule returns ``(accepted, next_token)``: the length of the accepted prefix (0..K) and
the token the target emits after it (correction at the first rejection, bonus after a
fully accepted block).
"""

from __future__ import annotations

import torch


def warp_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature / top-k / top-p warping; applied identically to drafter and target.

    Lossless sampling needs both distributions warped the same way: the rejection rule then
    reproduces the *warped* target distribution exactly.
    """
    logits = logits.float() / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row of ``probs`` [..., V]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def greedy_verdicts(
    draft: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy: d_j matches when it equals argmax q_j; the target's token is that argmax."""
    target_tokens = target_logits.argmax(-1)
    return draft == target_tokens[:, :-1], target_tokens


def speculative_verdicts(
    draft: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless rejection sampling (Leviathan et al.; Chen et al.), at every position.

    d_j passes with probability min(1, q_j(d_j) / p_j(d_j)). Where it fails, the target's
    token is a sample of norm(max(q_j - p_j, 0)); where it passes, the target's token is d_j
    itself; position K+1 holds the bonus sample from q_{K+1}. Sampling every position (not
    only the first rejection) lets an arbiter look past a rejection; the walk below then
    reproduces the target distribution exactly when every mismatch is rejected.
    """
    batch, k = draft.shape
    p_draft = p.gather(-1, draft[..., None]).squeeze(-1)
    q_draft = q[:, :k].gather(-1, draft[..., None]).squeeze(-1)
    u = torch.rand(p_draft.shape, generator=generator, device=p.device)
    matches = u * p_draft < q_draft
    residual = (q - torch.cat([p, p.new_zeros((batch, 1, p.shape[-1]))], dim=1)).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), q)
    target_tokens = sample(residual, generator)
    target_tokens[:, :k] = torch.where(matches, draft, target_tokens[:, :k])
    return matches, target_tokens


def walk(accept: torch.Tensor, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest prefix of accepted positions; emit the target's token after it."""
    accepted = accept.long().cumprod(-1).sum(-1)
    return accepted, target_tokens.gather(1, accepted[:, None]).squeeze(1)


def greedy_accept(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Greedy lossless SPD: the longest prefix where the draft equals the target's argmax."""
    return walk(*greedy_verdicts(draft, target_logits))


def speculative_accept(
    draft: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling lossless SPD: reproduces the (warped) target distribution exactly."""
    return walk(*speculative_verdicts(draft, p, q, generator))


def slim_tiers(
    draft: torch.Tensor, slim_probs: torch.Tensor, alpha_accept: float, alpha_regen: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """VIA-SD tiers 1-2 from the slim verifier's distributions q' [B, K+1, V].

    Tier 1 accepts d_j while r = q'(d_j) / max q' >= alpha_accept. At the first position
    that fails (or after a block accepted whole, for the bonus token), tier 2 settles the
    block with argmax q' when max q' >= alpha_regen; otherwise tier 3: the full target
    verifies the rest. Thresholds above 1 turn a tier off. Returns the number of tier-1
    tokens [B], whether each row is settled [B], and the slim verifier's tokens [B, K+1].
    """
    k = draft.shape[1]
    top, slim_tokens = slim_probs.max(-1)
    ratio = slim_probs[:, :k].gather(-1, draft[..., None]).squeeze(-1) / top[:, :k]
    slim_accepted = (ratio >= alpha_accept).long().cumprod(-1).sum(-1)
    top_at_stop = top.gather(1, slim_accepted[:, None]).squeeze(1)
    settled = top_at_stop >= alpha_regen
    return slim_accepted, settled, slim_tokens
