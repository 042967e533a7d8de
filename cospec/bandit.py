"""MetaSD: a multi-armed bandit that picks the drafter for each round (SPEC 2.3).

Arms are the drafters, rounds are SPD rounds, and the statistics are per sequence: every
query starts from a fresh :class:`BanditState`. The reward of a round is BD (block
divergence, the default) or BE (block efficiency), both in [0, 1].

The choice rules are pure functions of the arm statistics (:func:`ucb_scores`,
:func:`exp3_probabilities`), tested directly; a policy only keeps the statistics up to
date and applies its rule. :class:`BanditBatch` holds one state and one seeded random
stream per row of a decoding batch. The statistics are plain Python floats: a handful of
arms and one update per round cost less in Python than in tensor ops.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

from cospec.errors import CoSpecError

REWARDS = ("bd", "be")


# ---------------------------------------------------------------------------------------
# Rewards (batched: one reward per row)
# ---------------------------------------------------------------------------------------


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """TV(p, q) = 0.5 * sum_v |p(v) - q(v)| over the last dim (accumulated in >= fp32)."""
    acc_dtype = torch.promote_types(p.dtype, torch.float32)
    return (p - q).abs_().sum(dim=-1, dtype=acc_dtype).mul_(0.5)


def block_divergence_reward(
    p: torch.Tensor, q: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """BD per row: mean over the drafted block of 1 - TV(p_j, q_j).

    ``p`` (drafter) and ``q`` (target) are ``[batch, K, V]`` probabilities for the K draft
    positions (the target's bonus distribution q_{K+1} is not part of it). ``valid``
    (``[batch, K]`` bool) marks the positions a row actually drafted; a row with none gets 0.
    """
    agreement = 1.0 - total_variation(p, q)
    if valid is None:
        return agreement.mean(dim=-1)
    valid = valid.to(agreement.dtype)
    return (agreement * valid).sum(dim=-1) / valid.sum(dim=-1).clamp(min=1.0)


def block_efficiency_reward(accepted: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """BE per row: accepted draft tokens / K. ``k`` may be per row (rows drafting < K)."""
    k = torch.as_tensor(k, device=accepted.device)
    return accepted.to(torch.float32) / k.to(torch.float32).clamp(min=1.0)


def block_reward(
    reward: str,
    *,
    accepted: torch.Tensor,
    num_drafted: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    target_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """The configured reward (``"bd"`` or ``"be"``) of one round for every row.

    ``accepted`` and ``num_drafted`` are ``[batch]`` counts (``num_drafted`` <= K); BD also
    needs the ``[batch, K, V]`` drafter and target probabilities of the block.
    """
    if reward == "be":
        return block_efficiency_reward(accepted, num_drafted)
    if reward == "bd":
        if draft_probs is None or target_probs is None:
            raise ValueError("the bd reward needs draft_probs and target_probs")
        positions = torch.arange(draft_probs.shape[1], device=draft_probs.device)
        valid = positions < num_drafted.to(draft_probs.device)[:, None]
        return block_divergence_reward(draft_probs, target_probs, valid)
    raise CoSpecError(f"bandit reward {reward!r} is unknown; choose from {list(REWARDS)}")


# ---------------------------------------------------------------------------------------
# Pure choice rules
# ---------------------------------------------------------------------------------------


def arm_means(sums: Sequence[float], counts: Sequence[float]) -> list[float]:
    """Mean reward per arm; 0 for an arm with no (remaining) pulls."""
    return [s / c if c > 0 else 0.0 for s, c in zip(sums, counts, strict=True)]


def ucb_scores(
    means: Sequence[float], counts: Sequence[float], t: float, beta: float
) -> list[float]:
    """UCB index ``mean_i + beta * sqrt(2 ln t / n_i)``; ``inf`` for an untried arm.

    For discounted and sliding-window UCB, ``counts`` are the discounted / windowed counts
    and ``t`` is their sum.
    """
    log_t = math.log(max(t, 1.0))
    return [
        m + beta * math.sqrt(2.0 * log_t / n) if n > 0 else math.inf
        for m, n in zip(means, counts, strict=True)
    ]


def argmax(scores: Sequence[float]) -> int:
    """Index of the largest score; ties go to the lowest index."""
    return max(range(len(scores)), key=scores.__getitem__)


def exp3_probabilities(log_weights: Sequence[float], gamma: float) -> list[float]:
    """EXP3's arm distribution ``(1 - gamma) * w_i / sum(w) + gamma / n``."""
    top = max(log_weights)
    weights = [math.exp(w - top) for w in log_weights]
    total = sum(weights)
    uniform = gamma / len(weights)
    return [(1.0 - gamma) * w / total + uniform for w in weights]


# ---------------------------------------------------------------------------------------
# Per-sequence state and policies
# ---------------------------------------------------------------------------------------


@dataclass
class BanditState:
    """The statistics of one sequence. Create a fresh one per query (``policy.new_state()``).

    ``counts`` / ``sums`` are plain for UCB and the baselines, discounted for discounted UCB
    and restricted to the last W rounds (kept in ``history``) for sliding-window UCB.
    ``log_weights`` are EXP3's weights, ``t`` the number of rounds played.
    """

    counts: list[float]
    sums: list[float]
    log_weights: list[float]
    history: deque[tuple[int, float]] = field(default_factory=deque)
    t: int = 0

    @classmethod
    def fresh(cls, num_arms: int) -> BanditState:
        return cls(counts=[0.0] * num_arms, sums=[0.0] * num_arms, log_weights=[0.0] * num_arms)

    @property
    def means(self) -> list[float]:
        return arm_means(self.sums, self.counts)


@dataclass(frozen=True)
class BanditPolicy:
    """One rule for picking an arm from a sequence's state. Policies are stateless."""

    num_arms: int
    name: ClassVar[str] = ""

    def new_state(self) -> BanditState:
        return BanditState.fresh(self.num_arms)

    def select(self, state: BanditState, rng: random.Random) -> int:
        raise NotImplementedError

    def update(self, state: BanditState, arm: int, reward: float) -> None:
        state.t += 1
        state.counts[arm] += 1.0
        state.sums[arm] += reward


@dataclass(frozen=True)
class UCBPolicy(BanditPolicy):
    """UCB1 with exploration weight ``beta``; tries each arm once first (in index order)."""

    beta: float = 1.0
    name: ClassVar[str] = "ucb"

    def select(self, state: BanditState, rng: random.Random) -> int:
        t = sum(state.counts)
        return argmax(ucb_scores(state.means, state.counts, t, self.beta))


@dataclass(frozen=True)
class DiscountedUCBPolicy(UCBPolicy):
    """Discounted UCB: every round, all counts and sums are multiplied by ``gamma``."""

    gamma: float = 0.95
    name: ClassVar[str] = "discounted_ucb"

    def update(self, state: BanditState, arm: int, reward: float) -> None:
        state.counts = [self.gamma * c for c in state.counts]
        state.sums = [self.gamma * s for s in state.sums]
        super().update(state, arm, reward)


@dataclass(frozen=True)
class SlidingWindowUCBPolicy(UCBPolicy):
    """Sliding-window UCB: statistics over the last ``window`` rounds only."""

    window: int = 32
    name: ClassVar[str] = "sliding_window_ucb"

    def update(self, state: BanditState, arm: int, reward: float) -> None:
        if len(state.history) == self.window:
            old_arm, old_reward = state.history.popleft()
            state.counts[old_arm] -= 1.0
            state.sums[old_arm] -= old_reward
        state.history.append((arm, reward))
        super().update(state, arm, reward)


@dataclass(frozen=True)
class EXP3Policy(BanditPolicy):
    """EXP3 with exploration rate ``gamma``; rewards must lie in [0, 1]."""

    gamma: float = 0.1
    name: ClassVar[str] = "exp3"

    def select(self, state: BanditState, rng: random.Random) -> int:
        probs = exp3_probabilities(state.log_weights, self.gamma)
        return rng.choices(range(self.num_arms), weights=probs)[0]

    def update(self, state: BanditState, arm: int, reward: float) -> None:
        if not 0.0 <= reward <= 1.0:
            raise ValueError(f"EXP3 needs rewards in [0, 1], got {reward}")
        prob = exp3_probabilities(state.log_weights, self.gamma)[arm]
        state.log_weights[arm] += self.gamma * (reward / prob) / self.num_arms
        super().update(state, arm, reward)


@dataclass(frozen=True)
class FixedPolicy(BanditPolicy):
    """Baseline: always the drafter ``arm``."""

    arm: int = 0
    name: ClassVar[str] = "fixed"

    def select(self, state: BanditState, rng: random.Random) -> int:
        return self.arm


@dataclass(frozen=True)
class RoundRobinPolicy(BanditPolicy):
    """Baseline: drafters in turn, 0, 1, ..., n-1, 0, ..."""

    name: ClassVar[str] = "round_robin"

    def select(self, state: BanditState, rng: random.Random) -> int:
        return state.t % self.num_arms


@dataclass(frozen=True)
class RandomPolicy(BanditPolicy):
    """Baseline: a drafter drawn uniformly each round."""

    name: ClassVar[str] = "random"

    def select(self, state: BanditState, rng: random.Random) -> int:
        return rng.randrange(self.num_arms)


POLICIES: dict[str, type[BanditPolicy]] = {
    cls.name: cls
    for cls in (UCBPolicy, DiscountedUCBPolicy, SlidingWindowUCBPolicy, EXP3Policy,
                FixedPolicy, RoundRobinPolicy, RandomPolicy)
}


# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------


@dataclass
class BanditConfig:
    """MetaSD drafter selection. beta, gamma, window and exp3_gamma are our choices: the
    published work does not give them."""

    policy: str = field(
        default="ucb",
        metadata={"help": f"Drafter-selection policy, one of {list(POLICIES)}."},
    )
    reward: str = field(
        default="bd",
        metadata={"help": "Round reward: 'bd' (block divergence, mean of 1 - TV(p, q) over "
                          "the block) or 'be' (block efficiency, accepted / K)."},
    )
    beta: float = field(
        default=1.0,
        metadata={"help": "UCB exploration weight in mean_i + beta * sqrt(2 ln t / n_i) "
                          "(all UCB variants); >= 0."},
    )
    gamma: float = field(
        default=0.95,
        metadata={"help": "Discount per round of discounted UCB, in (0, 1]; 1 is plain UCB."},
    )
    window: int = field(
        default=32,
        metadata={"help": "Number of recent rounds sliding-window UCB keeps; >= 1."},
    )
    exp3_gamma: float = field(
        default=0.1,
        metadata={"help": "EXP3 exploration rate (share of the uniform distribution), "
                          "in (0, 1]."},
    )
    fixed_arm: int = field(
        default=0,
        metadata={"help": "Drafter index used by the 'fixed' policy."},
    )
    seed: int = field(
        default=0,
        metadata={"help": "Seed of the per-row random streams (EXP3, random policy)."},
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`CoSpecError` with a one-line message for a bad value."""
        if self.policy not in POLICIES:
            raise CoSpecError(
                f"bandit policy {self.policy!r} is unknown; choose from {list(POLICIES)}"
            )
        if self.reward not in REWARDS:
            raise CoSpecError(
                f"bandit reward {self.reward!r} is unknown; choose from {list(REWARDS)}"
            )
        if not (math.isfinite(self.beta) and self.beta >= 0):
            raise CoSpecError(f"bandit beta must be a finite number >= 0, got {self.beta}")
        if not 0 < self.gamma <= 1:
            raise CoSpecError(f"bandit gamma must be in (0, 1], got {self.gamma}")
        if not isinstance(self.window, int) or self.window < 1:
            raise CoSpecError(f"bandit window must be an integer >= 1, got {self.window!r}")
        if not 0 < self.exp3_gamma <= 1:
            raise CoSpecError(f"bandit exp3_gamma must be in (0, 1], got {self.exp3_gamma}")
        if not isinstance(self.fixed_arm, int) or self.fixed_arm < 0:
            raise CoSpecError(
                f"bandit fixed_arm must be an integer >= 0, got {self.fixed_arm!r}"
            )
        if not isinstance(self.seed, int):
            raise CoSpecError(f"bandit seed must be an integer, got {self.seed!r}")


def config_help() -> dict[str, str]:
    """Field name -> help text of :class:`BanditConfig`."""
    return {f.name: f.metadata["help"] for f in fields(BanditConfig)}


def make_policy(config: BanditConfig, num_arms: int) -> BanditPolicy:
    """The policy ``config`` names, for ``num_arms`` drafters."""
    config.validate()
    if num_arms < 1:
        raise CoSpecError(f"MetaSD needs at least one drafter, got {num_arms}")
    if config.policy == "ucb":
        return UCBPolicy(num_arms, beta=config.beta)
    if config.policy == "discounted_ucb":
        return DiscountedUCBPolicy(num_arms, beta=config.beta, gamma=config.gamma)
    if config.policy == "sliding_window_ucb":
        return SlidingWindowUCBPolicy(num_arms, beta=config.beta, window=config.window)
    if config.policy == "exp3":
        return EXP3Policy(num_arms, gamma=config.exp3_gamma)
    if config.policy == "fixed":
        if config.fixed_arm >= num_arms:
            raise CoSpecError(
                f"bandit fixed_arm {config.fixed_arm} is out of range for {num_arms} drafters"
            )
        return FixedPolicy(num_arms, arm=config.fixed_arm)
    return POLICIES[config.policy](num_arms)


# ---------------------------------------------------------------------------------------
# One state per row of a decoding batch
# ---------------------------------------------------------------------------------------


def row_rng(seed: int, row_id: int) -> random.Random:
    """The random stream of one row: depends on (seed, row id) only, not on the batch."""
    return random.Random(f"cospec-bandit:{seed}:{row_id}")


class BanditBatch:
    """One :class:`BanditState` and one random stream per row; one call per round.

    Row streams are seeded from ``(seed, row_id)``, so a row picks the same drafters
    whether it is decoded alone or in a batch (pass the query index as its row id).
    """

    def __init__(
        self, policy: BanditPolicy, states: list[BanditState], rngs: list[random.Random]
    ) -> None:
        if len(states) != len(rngs):
            raise ValueError("one random stream per state")
        self.policy = policy
        self.states = states
        self.rngs = rngs

    @classmethod
    def create(
        cls,
        policy: BanditPolicy,
        batch_size: int,
        *,
        seed: int = 0,
        row_ids: Sequence[int] | None = None,
    ) -> BanditBatch:
        row_ids = list(range(batch_size)) if row_ids is None else list(row_ids)
        if len(row_ids) != batch_size:
            raise ValueError(f"{len(row_ids)} row ids for a batch of {batch_size}")
        states = [policy.new_state() for _ in row_ids]
        return cls(policy, states, [row_rng(seed, r) for r in row_ids])

    @classmethod
    def from_config(
        cls,
        config: BanditConfig,
        num_arms: int,
        batch_size: int,
        row_ids: Sequence[int] | None = None,
    ) -> BanditBatch:
        return cls.create(
            make_policy(config, num_arms), batch_size, seed=config.seed, row_ids=row_ids
        )

    def __len__(self) -> int:
        return len(self.states)

    def select(self) -> list[int]:
        """The drafter of every row for this round."""
        return [self.policy.select(s, r) for s, r in zip(self.states, self.rngs, strict=True)]

    def update(self, arms: Sequence[int], rewards: torch.Tensor | Sequence[float]) -> None:
        """Record each row's reward for the drafter it used (one host sync for a tensor)."""
        if isinstance(rewards, torch.Tensor):
            rewards = rewards.tolist()
        if not len(arms) == len(rewards) == len(self.states):
            raise ValueError(
                f"{len(arms)} arms and {len(rewards)} rewards for {len(self.states)} rows"
            )
        for state, arm, reward in zip(self.states, arms, rewards, strict=True):
            self.policy.update(state, int(arm), float(reward))

    def select_rows(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Keep only the rows at ``indices`` (in that order), e.g. to drop finished rows."""
        if isinstance(indices, torch.Tensor):
            if indices.dtype == torch.bool:
                indices = indices.nonzero().flatten()
            indices = indices.tolist()
        self.states = [self.states[i] for i in indices]
        self.rngs = [self.rngs[i] for i in indices]
