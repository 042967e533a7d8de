"""Engine configuration: one dataclass, validated once, shared by every caller.

Field names follow the domain words of SPEC.md (``num_draft_tokens`` is K) and carry their
help text in ``metadata`` so the same dataclass can back a CLI or a YAML config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cospec.bandit import BanditConfig
from cospec.errors import CoSpecError

METHODS = ("target", "drafter", "spd")
ARBITER_MODES = ("off", "threshold", "sample", "always_accept", "always_reject")


@dataclass
class EngineConfig:
    """How to decode: which method, how many tokens to draft, how to sample, when to stop."""

    method: str = field(
        default="spd",
        metadata={"help": "target (target-only), drafter (drafter-only) or spd (speculative)"},
    )
    num_draft_tokens: int = field(default=4, metadata={"help": "K: tokens drafted per round"})
    temperature: float = field(
        default=0.0, metadata={"help": "0 decodes greedily; > 0 samples (lossless SPD sampling)"}
    )
    top_k: int = field(default=0, metadata={"help": "keep the k most likely tokens (0: off)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (1.0: off)"})
    max_new_tokens: int = field(default=128, metadata={"help": "tokens generated per prompt"})
    stop_strings: list[str] = field(
        default_factory=list, metadata={"help": "finish a sequence once its text contains one"}
    )
    eos_token_id: int | None = field(
        default=None, metadata={"help": "end-of-sequence id (default: the tokenizer's)"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the sampling generator"})
    batch_size: int = field(default=16, metadata={"help": "prompts decoded together"})
    dtype: str = field(default="float32", metadata={"help": "model dtype when loading by path"})
    device: str = field(
        default="auto", metadata={"help": "where models load by path: auto (cuda if any), cpu, "
                                          "cuda, cuda:N"}
    )
    attn_implementation: str = field(
        default="sdpa", metadata={"help": "sdpa or eager (custom masks exclude FlashAttention)"}
    )
    arbiter_mode: str = field(
        default="off",
        metadata={"help": "CoSpec decisions at mismatches: off (vanilla SPD), threshold "
                          "(accept when P >= arbiter_threshold), sample (Bernoulli, for GRPO), "
                          "always_accept, always_reject (sanity baselines)"},
    )
    arbiter_threshold: float = field(
        default=0.5, metadata={"help": "tau: accept a mismatched draft token when P >= tau"}
    )
    bandit: BanditConfig | dict[str, Any] | None = field(
        default=None,
        metadata={"help": "MetaSD drafter bandit (policy, reward, beta, gamma, window, ...); "
                          "required with more than one drafter"},
    )
    alpha_accept: float = field(
        default=0.9,
        metadata={"help": "VIA-SD tier 1: accept d_j when q'(d_j) / max q' >= alpha_accept "
                          "(> 1 turns tier 1 off)"},
    )
    alpha_regen: float = field(
        default=0.9,
        metadata={"help": "VIA-SD tier 2: else replace d_j by argmax q' when max q' >= "
                          "alpha_regen (> 1 turns tier 2 off); else tier 3 asks the target"},
    )
    compact_threshold: float = field(
        default=0.25,
        metadata={"help": "compact the column layout when holes exceed this share of it"},
    )

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise CoSpecError(f"unknown method {self.method!r}; choose from {list(METHODS)}")
        if self.num_draft_tokens < 1:
            raise CoSpecError(f"num_draft_tokens (K) must be >= 1, got {self.num_draft_tokens}")
        if self.max_new_tokens < 1:
            raise CoSpecError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise CoSpecError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise CoSpecError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise CoSpecError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.batch_size < 1:
            raise CoSpecError(f"batch_size must be >= 1, got {self.batch_size}")
        if isinstance(self.bandit, dict):
            try:
                self.bandit = BanditConfig(**self.bandit)
            except TypeError as err:
                raise CoSpecError(f"bad bandit config: {err}") from err
        for name in ("alpha_accept", "alpha_regen"):
            if getattr(self, name) < 0:
                raise CoSpecError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.arbiter_mode not in ARBITER_MODES:
            raise CoSpecError(
                f"unknown arbiter_mode {self.arbiter_mode!r}; choose from {list(ARBITER_MODES)}"
            )
        if self.arbiter_mode != "off" and self.method != "spd":
            raise CoSpecError(f"arbiter_mode {self.arbiter_mode!r} needs method 'spd'")
        if not 0 <= self.arbiter_threshold <= 1:
            raise CoSpecError(f"arbiter_threshold must be in [0, 1], got {self.arbiter_threshold}")
        if not 0 < self.compact_threshold <= 1:
            raise CoSpecError(f"compact_threshold must be in (0, 1], got {self.compact_threshold}")

    @property
    def resolved_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_arbiter_model(self) -> bool:
        return self.arbiter_mode in ("threshold", "sample")

    @property
    def drafts(self) -> bool:
        """Whether rounds draft at all (autoregressive methods emit one token per round)."""
        return self.method == "spd"
