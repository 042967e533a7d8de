"""MetaSD bandit: rewards against brute force, choice rules against hand-worked values,
policies against synthetic Bernoulli problems (stationary and with a change of best arm)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from cospec.bandit import (
    POLICIES,
    BanditBatch,
    BanditConfig,
    BanditPolicy,
    DiscountedUCBPolicy,
    EXP3Policy,
    FixedPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    SlidingWindowUCBPolicy,
    UCBPolicy,
    block_divergence_reward,
    block_efficiency_reward,
    block_reward,
    config_help,
    exp3_probabilities,
    make_policy,
    total_variation,
    ucb_scores,
)
from cospec.errors import CoSpecError


def random_probs(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).mul(2).softmax(-1)


def play(
    policy: BanditPolicy, means_at, rounds: int, seed: int
) -> list[int]:
    """Run ``policy`` on Bernoulli arms whose means at round t are ``means_at(t)``."""
    state = policy.new_state()
    rng, env = random.Random(seed), random.Random(seed + 1000)
    arms = []
    for t in range(rounds):
        arm = policy.select(state, rng)
        policy.update(state, arm, float(env.random() < means_at(t)[arm]))
        arms.append(arm)
    return arms


# --- rewards ---------------------------------------------------------------------------


def test_total_variation_matches_brute_force():
    p, q = random_probs(3, 4, 7, seed=0), random_probs(3, 4, 7, seed=1)
    tv = total_variation(p, q)
    assert tv.shape == (3, 4)
    for b in range(3):
        for j in range(4):
            expected = 0.5 * sum(abs(p[b, j, v].item() - q[b, j, v].item()) for v in range(7))
            assert tv[b, j].item() == pytest.approx(expected, abs=1e-12)
    assert torch.allclose(total_variation(p, p), torch.zeros(3, 4, dtype=torch.float64))


def test_total_variation_of_disjoint_supports_is_one():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    q = torch.tensor([[0.0, 0.0, 0.25, 0.75]])
    assert total_variation(p, q).item() == pytest.approx(1.0)


def test_block_divergence_matches_brute_force_with_mask():
    batch, k, vocab = 3, 5, 6
    p, q = random_probs(batch, k, vocab, seed=2), random_probs(batch, k, vocab, seed=3)
    drafted = [5, 2, 0]
    valid = torch.arange(k)[None, :] < torch.tensor(drafted)[:, None]
    bd = block_divergence_reward(p, q, valid)
    for b in range(batch):
        terms = [
            1 - 0.5 * sum(abs(p[b, j, v].item() - q[b, j, v].item()) for v in range(vocab))
            for j in range(drafted[b])
        ]
        expected = sum(terms) / len(terms) if terms else 0.0
        assert bd[b].item() == pytest.approx(expected, abs=1e-12)
    # Without a mask every position counts.
    full = block_divergence_reward(p, q)
    assert full[0].item() == pytest.approx(bd[0].item(), abs=1e-12)
    assert full[1].item() != pytest.approx(bd[1].item(), abs=1e-6)


def test_block_divergence_is_one_for_identical_distributions_in_bf16():
    p = random_probs(2, 3, 50, seed=4).to(torch.bfloat16)
    bd = block_divergence_reward(p, p.clone())
    assert bd.dtype == torch.float32
    assert torch.allclose(bd, torch.ones(2))


def test_block_efficiency():
    accepted = torch.tensor([0, 2, 4])
    assert block_efficiency_reward(accepted, 4).tolist() == [0.0, 0.5, 1.0]
    per_row_k = torch.tensor([4, 2, 4])
    assert block_efficiency_reward(accepted, per_row_k).tolist() == [0.0, 1.0, 1.0]


def test_block_reward_dispatches_and_masks_by_num_drafted():
    p, q = random_probs(2, 4, 5, seed=5), random_probs(2, 4, 5, seed=6)
    accepted, num_drafted = torch.tensor([1, 2]), torch.tensor([4, 2])
    be = block_reward("be", accepted=accepted, num_drafted=num_drafted)
    assert be.tolist() == [0.25, 1.0]
    bd = block_reward("bd", accepted=accepted, num_drafted=num_drafted,
                      draft_probs=p, target_probs=q)
    expected = block_divergence_reward(p, q, torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]) > 0)
    assert torch.allclose(bd, expected)
    with pytest.raises(CoSpecError):
        block_reward("kl", accepted=accepted, num_drafted=num_drafted)


# --- pure choice rules -----------------------------------------------------------------


def test_ucb_scores_hand_worked():
    scores = ucb_scores([0.5, 0.2, 0.0], [2, 1, 0], t=3, beta=0.5)
    assert scores[0] == pytest.approx(0.5 + 0.5 * math.sqrt(2 * math.log(3) / 2))
    assert scores[1] == pytest.approx(0.2 + 0.5 * math.sqrt(2 * math.log(3) / 1))
    assert scores[2] == math.inf
    assert ucb_scores([0.5, 0.2], [2, 1], t=3, beta=0.0) == [0.5, 0.2]


@pytest.mark.parametrize("gamma", [0.1, 0.5, 1.0])
def test_exp3_probabilities_are_valid(gamma):
    gen = random.Random(0)
    for n in (1, 2, 5):
        for spread in (0.0, 1.0, 1e3):
            log_weights = [gen.uniform(-spread, spread) for _ in range(n)]
            probs = exp3_probabilities(log_weights, gamma)
            assert len(probs) == n
            assert sum(probs) == pytest.approx(1.0)
            assert all(p >= gamma / n - 1e-12 for p in probs)
            assert all(math.isfinite(p) for p in probs)
    assert exp3_probabilities([0.0, math.log(3.0)], 0.2) == pytest.approx(
        [0.8 * 0.25 + 0.1, 0.8 * 0.75 + 0.1]
    )


def test_exp3_importance_weighted_update():
    policy = EXP3Policy(4, gamma=0.2)
    state = policy.new_state()
    policy.update(state, 1, 0.6)  # uniform probabilities: p = 0.25
    assert state.log_weights == pytest.approx([0.0, 0.2 * (0.6 / 0.25) / 4, 0.0, 0.0])
    with pytest.raises(ValueError):
        policy.update(state, 0, 1.5)


# --- policies --------------------------------------------------------------------------


@pytest.mark.parametrize("policy_cls", [UCBPolicy, DiscountedUCBPolicy, SlidingWindowUCBPolicy])
def test_ucb_variants_try_each_arm_once_first(policy_cls):
    policy = policy_cls(4)
    state = policy.new_state()
    rng = random.Random(0)
    first = []
    for _ in range(4):
        arm = policy.select(state, rng)
        policy.update(state, arm, 0.9)  # even a great reward does not stop exploration
        first.append(arm)
    assert sorted(first) == [0, 1, 2, 3]


def test_ucb_finds_best_arm_with_sublinear_regret():
    means = [0.2, 0.5, 0.8]
    rounds = 3000
    first_half = second_half = 0.0
    best_picks = 0
    for seed in range(5):
        arms = play(UCBPolicy(3), lambda t: means, rounds, seed)
        regret = [max(means) - means[a] for a in arms]
        first_half += sum(regret[: rounds // 2])
        second_half += sum(regret[rounds // 2:])
        best_picks += sum(a == 2 for a in arms[rounds // 2:])
    assert second_half < 0.5 * first_half
    assert best_picks / (5 * rounds // 2) > 0.9


def test_exp3_concentrates_on_best_arm():
    means = [0.2, 0.5, 0.8]
    policy = EXP3Policy(3, gamma=0.1)
    arms = play(policy, lambda t: means, 2000, seed=0)
    assert Counter(arms[1000:]).most_common(1)[0][0] == 2
    assert sum(a == 2 for a in arms[1000:]) / 1000 > 0.8


def test_discounted_and_sliding_window_ucb_recover_after_the_best_arm_changes():
    change, rounds = 400, 700

    def means_at(t):
        return (0.9, 0.5) if t < change else (0.3, 0.6)

    def new_best_rate(policy):
        picks = [play(policy, means_at, rounds, seed)[change:] for seed in range(5)]
        return sum(a == 1 for arms in picks for a in arms) / sum(map(len, picks))

    beta = 0.5
    plain = new_best_rate(UCBPolicy(2, beta=beta))
    discounted = new_best_rate(DiscountedUCBPolicy(2, beta=beta, gamma=0.95))
    windowed = new_best_rate(SlidingWindowUCBPolicy(2, beta=beta, window=32))
    assert discounted > 0.65 and windowed > 0.65
    assert discounted > plain + 0.25 and windowed > plain + 0.25


def test_sliding_window_forgets_rounds_outside_the_window():
    policy = SlidingWindowUCBPolicy(2, window=3)
    state = policy.new_state()
    for arm, reward in [(0, 1.0), (1, 0.5), (0, 0.0), (1, 1.0), (1, 0.0)]:
        policy.update(state, arm, reward)
    # Window holds the last three rounds: (0, 0.0), (1, 1.0), (1, 0.0).
    assert state.counts == [1.0, 2.0]
    assert state.sums == pytest.approx([0.0, 1.0])
    assert state.t == 5


def test_discounted_ucb_discounts_old_rounds():
    policy = DiscountedUCBPolicy(2, gamma=0.5)
    state = policy.new_state()
    for arm, reward in [(0, 1.0), (1, 0.5), (0, 0.0)]:
        policy.update(state, arm, reward)
    assert state.counts == pytest.approx([0.25 + 1.0, 0.5])
    assert state.sums == pytest.approx([0.25, 0.25])


def test_fixed_round_robin_and_random_behave_as_named():
    rng = random.Random(0)
    fixed = FixedPolicy(3, arm=2)
    state = fixed.new_state()
    picks = []
    for _ in range(10):
        picks.append(fixed.select(state, rng))
        fixed.update(state, picks[-1], 1.0)
    assert picks == [2] * 10

    rr = RoundRobinPolicy(3)
    state = rr.new_state()
    picks = []
    for _ in range(7):
        picks.append(rr.select(state, rng))
        rr.update(state, picks[-1], 0.0)
    assert picks == [0, 1, 2, 0, 1, 2, 0]

    uniform = RandomPolicy(3)
    state = uniform.new_state()
    draws = [uniform.select(state, rng) for _ in range(3000)]
    counts = Counter(draws)
    assert set(counts) == {0, 1, 2}
    assert all(abs(c / 3000 - 1 / 3) < 0.04 for c in counts.values())


def test_random_choices_are_reproducible_per_seed():
    config = BanditConfig(policy="random", seed=7)

    def picks(config):
        batch = BanditBatch.from_config(config, num_arms=4, batch_size=2)
        out = []
        for _ in range(20):
            arms = batch.select()
            batch.update(arms, [0.5, 0.5])
            out.append(arms)
        return out

    assert picks(config) == picks(BanditConfig(policy="random", seed=7))
    assert picks(config) != picks(BanditConfig(policy="random", seed=8))


# --- config ----------------------------------------------------------------------------


def test_make_policy_builds_each_named_policy():
    for name in POLICIES:
        policy = make_policy(BanditConfig(policy=name, fixed_arm=1), num_arms=3)
        assert policy.name == name and policy.num_arms == 3
    policy = make_policy(BanditConfig(policy="discounted_ucb", beta=0.3, gamma=0.8), 2)
    assert (policy.beta, policy.gamma) == (0.3, 0.8)
    assert make_policy(BanditConfig(policy="sliding_window_ucb", window=9), 2).window == 9
    assert make_policy(BanditConfig(policy="exp3", exp3_gamma=0.3), 2).gamma == 0.3
    assert make_policy(BanditConfig(policy="fixed", fixed_arm=1), 2).arm == 1


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"policy": "thompson"}, "policy"),
        ({"reward": "kl"}, "reward"),
        ({"beta": -0.1}, "beta"),
        ({"beta": float("nan")}, "beta"),
        ({"gamma": 0.0}, "gamma"),
        ({"gamma": 1.5}, "gamma"),
        ({"window": 0}, "window"),
        ({"exp3_gamma": 0.0}, "exp3_gamma"),
        ({"exp3_gamma": 2.0}, "exp3_gamma"),
        ({"fixed_arm": -1}, "fixed_arm"),
    ],
)
def test_config_errors_are_one_line_cospec_errors(kwargs, needle):
    with pytest.raises(CoSpecError) as info:
        BanditConfig(**kwargs)
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_make_policy_rejects_bad_arm_counts():
    with pytest.raises(CoSpecError, match="fixed_arm 2 is out of range for 2 drafters"):
        make_policy(BanditConfig(policy="fixed", fixed_arm=2), num_arms=2)
    with pytest.raises(CoSpecError, match="at least one drafter"):
        make_policy(BanditConfig(), num_arms=0)


def test_every_config_field_has_help():
    help_texts = config_help()
    assert set(help_texts) == {"policy", "reward", "beta", "gamma", "window", "exp3_gamma",
                               "fixed_arm", "seed"}
    assert all(text.strip() for text in help_texts.values())


# --- batch -----------------------------------------------------------------------------


def test_bandit_batch_select_rows_keeps_per_row_state():
    batch = BanditBatch.create(UCBPolicy(2, beta=0.1), batch_size=3)
    # Row r always gets reward 1 from arm r % 2 and 0 from the other arm.
    for _ in range(30):
        arms = batch.select()
        rewards = torch.tensor([float(a == r % 2) for r, a in enumerate(arms)])
        batch.update(arms, rewards)
    before = [(list(s.counts), list(s.sums)) for s in batch.states]
    batch.select_rows(torch.tensor([False, True, True]))
    assert len(batch) == 2
    assert [(s.counts, s.sums) for s in batch.states] == before[1:]
    batch.select_rows([1, 0])
    assert [(s.counts, s.sums) for s in batch.states] == [before[2], before[1]]
    # The kept rows still exploit their own best arm: row 2 -> arm 0, row 1 -> arm 1.
    assert batch.select() == [0, 1]


def test_bandit_batch_rows_pick_as_if_decoded_alone():
    config = BanditConfig(policy="exp3", seed=3)
    rewards = {0: [0.1, 0.9, 0.5], 1: [0.9, 0.1, 0.5], 2: [0.5, 0.5, 0.9]}

    def run(row_ids, rounds=40):
        batch = BanditBatch.from_config(config, 3, len(row_ids), row_ids=row_ids)
        history = []
        for _ in range(rounds):
            arms = batch.select()
            batch.update(arms, [rewards[r][a] for r, a in zip(row_ids, arms, strict=True)])
            history.append(arms)
        return [[h[i] for h in history] for i in range(len(row_ids))]

    together = run([0, 1, 2])
    assert together[1] == run([1])[0]
    assert together[2] == run([2])[0]
    assert together[0] != together[1]


def test_bandit_batch_rejects_mismatched_lengths():
    batch = BanditBatch.create(RoundRobinPolicy(2), batch_size=2)
    with pytest.raises(ValueError):
        batch.update([0], [1.0, 0.0])


def test_bandit_batch_rows_have_distinct_random_streams():
    batch = BanditBatch.from_config(BanditConfig(policy="random"), 4, 2, row_ids=[5, 6])
    picks = [batch.select() for _ in range(50)]
    assert [p[0] for p in picks] != [p[1] for p in picks]
