"""Token provenance colouring for ``cospec generate``.

Each emitted token is coloured by who produced it: a draft token the target accepted, a
token the target emitted itself (correction or bonus), a draft token the arbiter kept at a
mismatch, or a token the slim verifier settled (tiers 1-2).
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from cospec.engine.trace import TIER_TARGET, SequenceResult

STYLES = {"draft": "green", "target": "bold blue", "arbiter": "bold magenta", "slim": "yellow"}


def provenance(seq: SequenceResult) -> list[str]:
    """One label per emitted token, in order, from the round traces."""
    if not seq.rounds:
        return ["target"] * len(seq.token_ids)
    labels: list[str] = []
    for r in seq.rounds:
        kept = {m for m, d in zip(r.mismatches, r.arbiter_decisions, strict=False) if d}
        own = ["arbiter" if j in kept else "draft" for j in range(r.accepted)] + ["target"]
        labels += ["slim" if tier != TIER_TARGET else label
                   for label, tier in zip(own, r.tiers, strict=False)]
    return labels


def render_sequence(
    seq: SequenceResult, tokenizer: PreTrainedTokenizerBase, color: bool = True
) -> None:
    console = Console(no_color=not color, highlight=False)
    text = Text(seq.prompt, style="dim")
    for token, label in zip(seq.token_ids, provenance(seq), strict=False):
        text.append(tokenizer.decode([token], skip_special_tokens=True), style=STYLES[label])
    console.print(text)
    if color:
        legend = Text("  ")
        for label, style in STYLES.items():
            legend.append(f"■ {label}  ", style=style)
        console.print(legend)
