"""Vanilla SPD rollouts, the mismatches they met, and the draft branches at those mismatches.

A rollout is greedy, target-faithful SPD on one prompt; its per-round traces say, for every
round, the draft block, the target's token at each block position and where they disagreed.
The *target branch* at a mismatch is the rollout itself (vanilla SPD emits the target
token); the *draft branch* keeps the draft token instead and is completed by the same
vanilla engine. Only the draft branch costs a new completion.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass

from cospec.engine import Engine, RoundTrace
from cospec.errors import CoSpecError
from data_gen.tasks import TaskItem


@dataclass(frozen=True)
class Mismatch:
    """A block position where the draft token differs from the target's, with its round.

    ``context_length`` counts the tokens of the rollout's sequence (prompt included) before
    the round's block; ``target_tokens`` are the target's tokens at the K block positions.
    """

    round_index: int
    context_length: int
    position: int
    draft_tokens: tuple[int, ...]
    target_tokens: tuple[int, ...]
    draft_prob: float
    target_prob: float

    def draft_branch_prefix(self, sequence_ids: Sequence[int]) -> list[int]:
        """The committed context, the block's tokens before the mismatch, and d_j."""
        return [*sequence_ids[: self.context_length], *self.draft_tokens[: self.position + 1]]


@dataclass
class Rollout:
    """One prompt's vanilla SPD completion and its round traces."""

    rollout_id: str
    prompt_index: int
    item: TaskItem
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    rounds: list[RoundTrace]

    @property
    def sequence_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.completion_ids]

    def mismatches(self) -> tuple[list[Mismatch], int]:
        """Every mismatch the rollout reached, and how many listed ones it did not reach.

        A round's trace lists the mismatch its walk met, but the emitted tokens can stop
        before it (end of sequence, stop string or budget inside the accepted prefix); the
        target token there was never committed, so there is no target branch to compare.
        """
        found, unreached = [], 0
        context = len(self.prompt_ids)
        for index, trace in enumerate(self.rounds):
            emitted = len(trace.tiers)  # one tier per emitted token
            k = len(trace.draft_tokens)
            for j in trace.mismatches:
                if j >= emitted:
                    unreached += 1
                    continue
                found.append(Mismatch(
                    round_index=index, context_length=context, position=j,
                    draft_tokens=tuple(trace.draft_tokens),
                    target_tokens=tuple(trace.target_tokens[:k]),
                    draft_prob=float(trace.draft_probs[j]),
                    target_prob=float(trace.target_probs[j]),
                ))
            context += emitted
        if context != len(self.sequence_ids):
            raise CoSpecError(
                f"rollout {self.rollout_id}: round traces account for {context} tokens, the "
                f"sequence has {len(self.sequence_ids)}"
            )
        return found, unreached


def run_rollouts(
    engine: Engine, items: Sequence[TaskItem], prompt_indices: Sequence[int], task: str
) -> tuple[list[Rollout], int, float]:
    """Vanilla SPD on the items; returns the rollouts, tokens emitted and seconds."""
    output = engine.generate([item.prompt for item in items])
    rollouts = [
        Rollout(f"{task}-{index}", index, item, seq.prompt_ids, seq.token_ids, seq.text,
                seq.rounds)
        for index, item, seq in zip(prompt_indices, items, output.sequences, strict=True)
    ]
    return rollouts, output.stats.emitted_tokens, output.stats.seconds["total"]


def select_judged(rollout_id: str, num_mismatches: int, cap: int, seed: int) -> list[int]:
    """Indices of the mismatches to judge: all, or ``cap`` drawn by a per-rollout RNG.

    The RNG is seeded by the run seed and the rollout id, so the draw does not depend on
    shards, batches or processes.
    """
    if cap == 0 or num_mismatches <= cap:
        return list(range(num_mismatches))
    return sorted(random.Random(f"{seed}/{rollout_id}").sample(range(num_mismatches), cap))


@dataclass
class BranchCompletions:
    """Completion ids (after the prompt) of every draft branch, per rollout, and the cost."""

    completions: list[list[list[int]]]
    generated_tokens: int
    seconds: float


def complete_draft_branches(
    engine: Engine, rollouts: Sequence[Rollout], mismatches: Sequence[Sequence[Mismatch]]
) -> BranchCompletions:
    """Complete the draft branch of every mismatch with the vanilla engine, in one batch.

    A branch ends where a from-scratch greedy run would: at end of sequence (d_j itself may
    be it), a stop string, or the rollout's token budget counted from the prompt. Branches
    still open are decoded together, shortest prefixes first (less padding), with the
    largest remaining budget, then each is cut to its own budget; greedy decoding of a row
    does not depend on its batch or on the budget beyond its cut, so this equals decoding
    each branch alone.
    """
    cfg = engine.config
    tokenizer = engine.tokenizer
    branches: list[list[int]] = []  # completion ids so far, flattened over rollouts
    prompts: list[list[int]] = []
    for rollout, found in zip(rollouts, mismatches, strict=True):
        for mismatch in found:
            prefix = mismatch.draft_branch_prefix(rollout.sequence_ids)
            prompts.append(prefix)
            branches.append(prefix[len(rollout.prompt_ids):])
    open_rows = [i for i, done in enumerate(branches) if not _finished(done, engine)]
    generated, seconds = 0, 0.0
    if open_rows:
        open_rows.sort(key=lambda i: len(prompts[i]))
        budget = max(cfg.max_new_tokens - len(branches[i]) for i in open_rows)
        branch_engine = Engine(engine.target, tokenizer, engine.drafters,
                               dataclasses.replace(cfg, max_new_tokens=budget))
        output = branch_engine.generate([prompts[i] for i in open_rows])
        generated, seconds = output.stats.emitted_tokens, output.stats.seconds["total"]
        for i, seq in zip(open_rows, output.sequences, strict=True):
            head = len(branches[i])
            branches[i] = _cut_at_stop([*branches[i], *seq.token_ids[: cfg.max_new_tokens - head]],
                                       head, engine)
    completions, offset = [], 0
    for found in mismatches:
        completions.append(branches[offset: offset + len(found)])
        offset += len(found)
    return BranchCompletions(completions, generated, seconds)


def _finished(completion: list[int], engine: Engine) -> bool:
    """Whether a branch's completion so far already ends where the engine would stop."""
    cfg = engine.config
    if len(completion) >= cfg.max_new_tokens or (completion and completion[-1] ==
                                                 engine.eos_token_id):
        return True
    if not cfg.stop_strings:
        return False
    text = engine.tokenizer.decode(completion)
    return any(s in text for s in cfg.stop_strings)


def _cut_at_stop(completion: list[int], start: int, engine: Engine) -> list[int]:
    """Cut after the first token from ``start`` on that completes a stop string.

    The branch engine only watched its own continuation; a stop string that straddles the
    branch prefix and the continuation is found here.
    """
    stops = engine.config.stop_strings
    decode = engine.tokenizer.decode
    if not stops or not any(s in decode(completion) for s in stops):
        return completion
    for end in range(start + 1, len(completion) + 1):
        if any(s in decode(completion[:end]) for s in stops):
            return completion[:end]
    return completion
