"""The toy world's models: stock HF Llama configs and the data mixture each is trained on.

The mixtures create the *designed complementarity* the arbiter must learn to exploit: the
target sees subtraction in about 1% of its math data, while the math drafter sees mostly
subtraction and addition and only a trickle of the other kinds. The target is better
overall; the drafter solves the subtraction problems the target gets wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from transformers import LlamaConfig

WORLD_DIR = Path(__file__).parent / "world"
MODEL_NAMES = ("target", "drafter_math", "drafter_string")
# A deeper target for the slim-verifier (VIA-SD) experiments: with 4 layers, only layers 1-2
# can be skipped, which leaves DIMR a handful of masks to choose from. A generalist drafter
# for the MetaSD experiments: trained on both families, it is a close second to each
# specialist, so a bandit must tell near-equal arms apart (two specialists differ so much
# that one pull of each settles the choice). Two small specialists (1 layer, hidden 32,
# about 1/50 of the target's parameters; the published 68M drafters are about 1/100 of a
# 7B target) put MetaSD in the published regime where BE is 0 in about half of even the
# best drafter's rounds; the full specialists accept so much that BE is almost never 0.
EXTRA_MODEL_NAMES = ("target_deep", "drafter_mixed", "drafter_math_small", "drafter_string_small")
WORLD_MODEL_NAMES = MODEL_NAMES + EXTRA_MODEL_NAMES
TOY_PREFIX = "toy:"


@dataclass(frozen=True)
class ToyModelSpec:
    """Architecture, data mixture and training budget of one toy model."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    family_weights: dict[str, float]
    kind_weights: dict[str, dict[str, float]] = field(default_factory=dict)
    max_steps: int = 2000
    learning_rate: float = 3e-3
    batch_size: int = 32
    warmup_steps: int = 50

    def config(self, vocab_size: int, bos: int, eos: int, pad: int) -> LlamaConfig:
        """A plain LlamaConfig; 3x hidden MLP and tied embeddings keep the files small."""
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=3 * self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
        )


SPECS: dict[str, ToyModelSpec] = {
    "target": ToyModelSpec(
        name="target", num_layers=4, hidden_size=128, num_heads=4,
        family_weights={"math": 0.6, "string": 0.4},
        kind_weights={"math": {"add": 1.0, "sub": 0.03, "mul-add": 1.0, "div": 1.0}},
        max_steps=2400,
    ),
    "target_deep": ToyModelSpec(
        name="target_deep", num_layers=8, hidden_size=96, num_heads=4,
        family_weights={"math": 0.6, "string": 0.4},
        kind_weights={"math": {"add": 1.0, "sub": 0.03, "mul-add": 1.0, "div": 1.0}},
        max_steps=1600,
    ),
    "drafter_math": ToyModelSpec(
        name="drafter_math", num_layers=2, hidden_size=64, num_heads=4,
        family_weights={"math": 1.0},
        kind_weights={"math": {"add": 0.35, "sub": 0.45, "mul-add": 0.1, "div": 0.1}},
        max_steps=1200,
    ),
    "drafter_string": ToyModelSpec(
        name="drafter_string", num_layers=2, hidden_size=64, num_heads=4,
        family_weights={"string": 1.0},
        max_steps=1200,
    ),
    "drafter_mixed": ToyModelSpec(
        name="drafter_mixed", num_layers=2, hidden_size=64, num_heads=4,
        family_weights={"math": 0.5, "string": 0.5},
        max_steps=600,
    ),
    "drafter_math_small": ToyModelSpec(
        name="drafter_math_small", num_layers=1, hidden_size=32, num_heads=2,
        family_weights={"math": 1.0},
        kind_weights={"math": {"add": 0.35, "sub": 0.45, "mul-add": 0.1, "div": 0.1}},
        max_steps=300,
    ),
    "drafter_string_small": ToyModelSpec(
        name="drafter_string_small", num_layers=1, hidden_size=32, num_heads=2,
        family_weights={"string": 1.0},
        max_steps=300,
    ),
}


def toy_model_path(name: str, world_dir: Path = WORLD_DIR) -> Path:
    """Where toy model ``name`` lives inside a built world."""
    return world_dir / name
