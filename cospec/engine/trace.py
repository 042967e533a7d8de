"""What the engine records: per-round traces, per-sequence results and run statistics.

Training (judge labels, GRPO rewards) and evaluation read these records; nothing
recomputes them. All are plain dataclasses that serialise to JSON with ``to_dict``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

TIER_SLIM_ACCEPT = 1
TIER_SLIM_REGENERATE = 2
TIER_TARGET = 3


@dataclass
class RoundTrace:
    """One round of one sequence.

    ``target_tokens`` are the target's choices at each block position (greedy argmax; under
    sampling the emitted correction/bonus at ``accepted``). ``tiers`` has one entry per
    emitted token. Arbiter fields stay empty unless an arbiter ran.
    """

    drafter: int | None
    draft_tokens: list[int]
    draft_probs: list[float]
    target_probs: list[float]
    target_tokens: list[int]
    accepted: int
    next_token: int
    mismatches: list[int]
    tiers: list[int]
    arbiter_probs: list[float] = field(default_factory=list)
    arbiter_decisions: list[bool] = field(default_factory=list)
    bandit_reward: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SequenceResult:
    """The decoded continuation of one prompt."""

    prompt: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    rounds: list[RoundTrace]

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def mean_accepted_length(self) -> float:
        """vLLM's definition: 1 + accepted draft tokens / rounds."""
        return 1.0 + self.accepted / max(1, len(self.rounds))

    def to_dict(self) -> dict:
        out = asdict(self)
        out["mean_accepted_length"] = self.mean_accepted_length
        return out


@dataclass
class EngineStats:
    """Counts and timings of one ``generate`` call.

    ``*_row_forwards`` count one per row per forward call, so they are comparable between
    batch sizes: ``target_forwards_per_token`` is 1.0 for target-only decoding.
    """

    rounds: int = 0
    emitted_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    target_calls: int = 0
    target_row_forwards: int = 0
    drafter_calls: dict[int, int] = field(default_factory=dict)
    drafter_switches: int = 0
    slim_calls: int = 0
    tokens_per_tier: dict[int, int] = field(default_factory=dict)
    mismatches: int = 0
    arbiter_accepts: int = 0
    compactions: int = 0
    seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("draft", "verify", "accept", "commit", "total"),
                                              0.0)
    )

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted_tokens / max(1, self.rounds)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / max(1, self.drafted_tokens)

    @property
    def target_forwards_per_token(self) -> float:
        return self.target_row_forwards / max(1, self.emitted_tokens)

    @property
    def arbiter_accept_rate(self) -> float | None:
        """Share of arbitrated mismatches where the draft token was kept."""
        return self.arbiter_accepts / self.mismatches if self.mismatches else None

    @property
    def tokens_per_second(self) -> float:
        return self.emitted_tokens / max(1e-9, self.seconds["total"])

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            mean_accepted_length=self.mean_accepted_length,
            acceptance_rate=self.acceptance_rate,
            target_forwards_per_token=self.target_forwards_per_token,
            arbiter_accept_rate=self.arbiter_accept_rate,
            tokens_per_second=self.tokens_per_second,
        )
        return out


@dataclass
class GenerationOutput:
    """Results in prompt order plus the statistics of the whole call."""

    sequences: list[SequenceResult]
    stats: EngineStats

    def to_dict(self) -> dict:
        return {"sequences": [s.to_dict() for s in self.sequences], "stats": self.stats.to_dict()}
