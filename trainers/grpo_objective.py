"""Stage 2 objective pieces: shaped rollout rewards, group advantages, the decision loss.

Pure functions, tested against hand-worked examples. The GRPO recipe (``grpo.py``) wires
them to engine rollouts; names follow TRL's GRPOConfig where the meaning is the same
(``scale_rewards``, ``epsilon``, ``epsilon_high``, ``beta``, ``loss_type``).

Reward design (SPEC 3.3; the published text gives only the shape, the details are ours):

- correct answer: ``R = 1 + lambda_span * rho``, where rho is the share of emitted tokens
  that were draft tokens accepted at or after the first mismatch of their round: the
  speed the collaboration bought beyond what vanilla SPD would have kept;
- wrong answer: ``R = -lambda_risk * risky - lambda_fallback * fallback``, where ``risky``
  is the share of *accepted* mismatches whose draft token had target probability below
  ``tau_risk`` and ``fallback`` the share of mismatches that were rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cospec.engine.trace import RoundTrace
from cospec.errors import CoSpecError

SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "dapo")


@dataclass(frozen=True)
class RewardWeights:
    """Coefficients of the shaped reward."""

    lambda_span: float = 0.5
    lambda_risk: float = 0.5
    lambda_fallback: float = 0.25
    tau_risk: float = 0.05


@dataclass(frozen=True)
class RolloutSummary:
    """What the reward needs from one rollout's trace."""

    correct: bool
    emitted: int
    collaborative_tokens: int
    mismatches: int
    accepted_mismatches: int
    risky_accepts: int


def summarise_rollout(
    rounds: Sequence[RoundTrace], emitted: int, correct: bool, tau_risk: float
) -> RolloutSummary:
    """Count, from the trace, the tokens bought by accepted mismatches and the risky accepts."""
    collaborative = mismatches = accepted = risky = 0
    for r in rounds:
        if r.mismatches and r.mismatches[0] < r.accepted:
            collaborative += r.accepted - r.mismatches[0]
        for j, keep in zip(r.mismatches, r.arbiter_decisions, strict=False):
            mismatches += 1
            if keep:
                accepted += 1
                risky += int(r.target_probs[j] < tau_risk)
    return RolloutSummary(correct, emitted, collaborative, mismatches, accepted, risky)


def shaped_reward(summary: RolloutSummary, weights: RewardWeights) -> float:
    if summary.correct:
        rho = summary.collaborative_tokens / max(1, summary.emitted)
        return 1.0 + weights.lambda_span * rho
    accepted = summary.accepted_mismatches
    risky = summary.risky_accepts / accepted if accepted else 0.0
    rejected = summary.mismatches - summary.accepted_mismatches
    fallback = rejected / summary.mismatches if summary.mismatches else 0.0
    return -weights.lambda_risk * risky - weights.lambda_fallback * fallback


def group_advantages(
    rewards: torch.Tensor, correct: torch.Tensor, scale_rewards: str = "group", eps: float = 1e-6
) -> torch.Tensor:
    """Advantages for rewards [groups, G] with correctness flags [groups, G].

    Centred on each group's mean and divided by the group's std ("group"), the whole
    batch's std ("batch") or nothing ("none"). In a mixed group (some correct, some
    wrong) a correct rollout never gets a negative advantage and a wrong one never a
    positive one, and the positive and negative sides are rescaled to equal total
    magnitude (the group's total |advantage| is kept), so both outcomes pull equally hard.
    A group with identical rewards gets zero advantages: no gradient.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise CoSpecError(f"unknown scale_rewards {scale_rewards!r}; choose from {SCALE_REWARDS}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        centred = centred / (rewards.std(dim=1, keepdim=True) + eps)
    elif scale_rewards == "batch":
        centred = centred / (rewards.std() + eps)
    correct = correct.bool()
    mixed = (correct.any(dim=1) & ~correct.all(dim=1))[:, None]
    clipped = torch.where(correct, centred.clamp_min(0), centred.clamp_max(0))
    positive = clipped.clamp_min(0).sum(dim=1, keepdim=True)
    negative = (-clipped).clamp_min(0).sum(dim=1, keepdim=True)
    total = centred.abs().sum(dim=1, keepdim=True)
    rescaled = torch.where(clipped > 0, clipped * total / (2 * positive).clamp_min(eps),
                           clipped * total / (2 * negative).clamp_min(eps))
    return torch.where(mixed, rescaled, centred)


def bernoulli_log_prob(accept_logit: torch.Tensor, decision: torch.Tensor) -> torch.Tensor:
    """log pi(decision) for a Bernoulli policy with logit of 'accept'."""
    return -torch.nn.functional.binary_cross_entropy_with_logits(
        accept_logit, decision.float(), reduction="none")


def bernoulli_kl(logit: torch.Tensor, reference_logit: torch.Tensor) -> torch.Tensor:
    """Exact KL(pi || pi_ref) between two Bernoulli policies, per decision."""
    log_p, log_q = torch.nn.functional.logsigmoid(logit), torch.nn.functional.logsigmoid(
        reference_logit)
    log_1p, log_1q = torch.nn.functional.logsigmoid(-logit), torch.nn.functional.logsigmoid(
        -reference_logit)
    p = logit.sigmoid()
    return p * (log_p - log_q) + (1 - p) * (log_1p - log_1q)


def clipped_surrogate_loss(
    logits: torch.Tensor,
    decisions: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    rollout_index: torch.Tensor,
    num_rollouts: int,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    reference_logits: torch.Tensor | None = None,
    loss_type: str = "grpo",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-style clipped surrogate over arbiter decisions (one entry per decision).

    ``advantages`` are per decision (the rollout's advantage repeated). ``loss_type``
    "grpo" averages each rollout's decisions, then the rollouts; "dapo" averages over all
    decisions of the batch. ``beta`` > 0 adds the exact Bernoulli KL to the reference
    (stage-1) policy. Returns the loss and detached metrics.
    """
    if loss_type not in LOSS_TYPES:
        raise CoSpecError(f"unknown loss_type {loss_type!r}; choose from {LOSS_TYPES}")
    high = epsilon if epsilon_high is None else epsilon_high
    log_probs = bernoulli_log_prob(logits, decisions)
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - epsilon, 1 + high) * advantages
    per_decision = -torch.min(unclipped, clipped)
    kl = torch.zeros_like(per_decision)
    if beta > 0:
        if reference_logits is None:
            raise CoSpecError("beta > 0 needs the reference policy's logits")
        kl = bernoulli_kl(logits, reference_logits)
        per_decision = per_decision + beta * kl
    if loss_type == "grpo":
        counts = torch.zeros(num_rollouts, device=logits.device).index_add_(
            0, rollout_index, torch.ones_like(per_decision))
        sums = torch.zeros(num_rollouts, device=logits.device).index_add_(
            0, rollout_index, per_decision)
        loss = (sums / counts.clamp_min(1)).sum() / num_rollouts
    else:
        loss = per_decision.sum() / max(1, per_decision.numel())
    p = logits.detach().sigmoid()
    entropy = -(p * p.clamp_min(1e-12).log() + (1 - p) * (1 - p).clamp_min(1e-12).log())
    metrics = {
        "clip_fraction": float(((ratio < 1 - epsilon) | (ratio > 1 + high)).float().mean())
        if ratio.numel() else 0.0,
        "kl": float(kl.detach().mean()) if kl.numel() else 0.0,
        "entropy": float(entropy.mean()) if entropy.numel() else 0.0,
    }
    return loss, metrics
