"""GRPO rewards, advantages and the decision loss against hand-worked examples."""

from __future__ import annotations

import math

import pytest
import torch

from cospec.engine.trace import RoundTrace
from cospec.errors import CoSpecError
from trainers.grpo_objective import (
    RewardWeights,
    RolloutSummary,
    bernoulli_kl,
    clipped_surrogate_loss,
    group_advantages,
    shaped_reward,
    summarise_rollout,
)

W = RewardWeights(lambda_span=0.5, lambda_risk=0.4, lambda_fallback=0.2, tau_risk=0.1)


def round_trace(accepted, mismatches, decisions, target_probs=(0.5, 0.5, 0.5, 0.5)):
    return RoundTrace(drafter=0, draft_tokens=[1, 2, 3, 4], draft_probs=[0.9] * 4,
                      target_probs=list(target_probs), target_tokens=[1, 2, 3, 4, 5],
                      accepted=accepted, next_token=5, mismatches=mismatches, tiers=[3],
                      arbiter_probs=[0.5] * len(mismatches), arbiter_decisions=decisions)


def test_summary_counts_collaborative_tokens_and_risky_accepts():
    rounds = [
        round_trace(4, [1, 3], [True, True], target_probs=(0.9, 0.05, 0.9, 0.5)),  # 3 bought
        round_trace(2, [2], [False]),  # plain SPD round: nothing bought, one fallback
        round_trace(3, [0, 3], [True, False], target_probs=(0.01, 0.9, 0.9, 0.9)),  # 3 bought
    ]
    s = summarise_rollout(rounds, emitted=12, correct=True, tau_risk=0.1)
    assert s == RolloutSummary(True, 12, 6, 5, 3, 2)


def test_correct_reward_pays_for_collaboration():
    s = RolloutSummary(True, 20, 5, 4, 2, 1)
    assert shaped_reward(s, W) == pytest.approx(1 + 0.5 * 5 / 20)
    assert shaped_reward(RolloutSummary(True, 20, 0, 0, 0, 0), W) == 1.0


def test_wrong_reward_penalises_risky_accepts_and_fallbacks():
    s = RolloutSummary(False, 20, 5, 4, 2, 1)  # 1 of 2 accepts risky, 2 of 4 rejected
    assert shaped_reward(s, W) == pytest.approx(-0.4 * 0.5 - 0.2 * 0.5)
    only_fallback = RolloutSummary(False, 20, 0, 3, 0, 0)
    assert shaped_reward(only_fallback, W) == pytest.approx(-0.2)
    assert shaped_reward(RolloutSummary(False, 20, 0, 0, 0, 0), W) == 0.0


def test_group_advantages_all_equal_group_has_no_gradient():
    adv = group_advantages(torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([[1, 1, 1]]))
    assert torch.all(adv == 0)


def test_group_advantages_plain_normalisation():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    adv = group_advantages(rewards, torch.tensor([[1, 1, 1]]), "group")
    assert adv[0].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-5)
    none = group_advantages(rewards, torch.tensor([[1, 1, 1]]), "none")
    assert none[0].tolist() == pytest.approx([-1.0, 0.0, 1.0])


def test_mixed_group_signs_follow_correctness_with_equal_mass():
    # rewards 3, 1 (correct), 0, -6 (wrong): mean -0.5, centred 3.5, 1.5, 0.5, -5.5 (total
    # 11). The wrong 0.0 sits above the mean and is clipped to 0; each side then carries
    # half of the total: correct 3.5 * 11 / 10 and 1.5 * 11 / 10, wrong -5.5.
    rewards = torch.tensor([[3.0, 1.0, 0.0, -6.0]])
    adv = group_advantages(rewards, torch.tensor([[1, 1, 0, 0]]), "none")[0]
    assert adv.tolist() == pytest.approx([3.85, 1.65, 0.0, -5.5])
    assert adv[:2].sum() == pytest.approx(-adv[2:].sum())


def test_batch_scaling_uses_the_batch_std():
    rewards = torch.tensor([[1.0, 3.0], [0.0, 10.0]])
    adv = group_advantages(rewards, torch.ones(2, 2), "batch")
    std = rewards.std().item()
    assert adv[0].tolist() == pytest.approx([-1 / std, 1 / std], rel=1e-4)


def test_bernoulli_kl_matches_formula():
    logit, ref = torch.tensor([0.3]), torch.tensor([-1.0])
    p, q = torch.sigmoid(logit), torch.sigmoid(ref)
    expected = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    assert bernoulli_kl(logit, ref).item() == pytest.approx(expected.item(), rel=1e-5)
    assert bernoulli_kl(logit, logit).item() == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("advantage,decision", [(1.0, 1), (1.0, 0), (-1.0, 1), (-1.0, 0)])
def test_surrogate_gradient_sign(advantage, decision):
    """Descending the loss raises pi(decision) for a positive advantage, lowers it for a
    negative one."""
    logit = torch.tensor([0.2], requires_grad=True)
    decisions = torch.tensor([decision])
    old = -torch.nn.functional.binary_cross_entropy_with_logits(
        logit.detach(), decisions.float(), reduction="none")
    loss, _ = clipped_surrogate_loss(logit, decisions, old, torch.tensor([advantage]),
                                     torch.tensor([0]), 1)
    loss.backward()
    prob_of_decision_grad = logit.grad.item() * (1 if decision == 1 else -1)
    assert (prob_of_decision_grad < 0) == (advantage > 0)


def test_clipping_stops_the_gradient_outside_the_trust_region():
    logit = torch.tensor([3.0], requires_grad=True)
    decisions = torch.tensor([1])
    old = torch.log(torch.tensor([0.5]))  # ratio = 0.95 / 0.5 > 1 + epsilon
    loss, metrics = clipped_surrogate_loss(logit, decisions, old, torch.tensor([1.0]),
                                           torch.tensor([0]), 1, epsilon=0.2)
    loss.backward()
    assert logit.grad.item() == 0.0 and metrics["clip_fraction"] == 1.0


def test_loss_types_aggregate_differently():
    logits = torch.zeros(3)
    decisions = torch.tensor([1, 1, 0])
    old = torch.log(torch.full((3,), 0.5))
    adv = torch.tensor([1.0, 1.0, -2.0])
    index = torch.tensor([0, 0, 1])
    grpo, _ = clipped_surrogate_loss(logits, decisions, old, adv, index, 2, loss_type="grpo")
    dapo, _ = clipped_surrogate_loss(logits, decisions, old, adv, index, 2, loss_type="dapo")
    assert grpo.item() == pytest.approx((-1.0 + 2.0) / 2)
    assert dapo.item() == pytest.approx((-1 - 1 + 2) / 3)
    with pytest.raises(CoSpecError, match="loss_type"):
        clipped_surrogate_loss(logits, decisions, old, adv, index, 2, loss_type="ppo")
