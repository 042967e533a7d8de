"""Judges: is each branch at a mismatch right? Labels follow from the two verdicts.

Both judges complete the draft branches with the vanilla engine (the target branch is the
rollout itself) and differ in how a completed branch is called right:

- :class:`OutcomeJudge` (the default) grades it with the task's grader.
- :class:`ModelJudge` asks a judge LM, for tasks without a grader: it reads the judge's
  next-token probabilities of a "yes" and a "no" token after a question about the
  completion, and calls the branch right when P(yes) >= P(no).

SPEC 3.1's labels: draft branch right and target branch wrong -> accept (1); draft wrong
and target right -> reject (0); both right -> accept with a lower weight; both wrong ->
reject with a low weight, or skipped when that weight is 0.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from cospec.engine import Engine
from cospec.errors import CoSpecError
from data_gen.rollouts import Mismatch, Rollout, complete_draft_branches

OUTCOMES = ("draft_only", "target_only", "both_correct", "both_wrong")


def outcome_of(draft_branch_correct: bool, target_branch_correct: bool) -> str:
    """Which branches are right: ``draft_only``, ``target_only``, ``both_correct``, ..."""
    if draft_branch_correct:
        return "both_correct" if target_branch_correct else "draft_only"
    return "target_only" if target_branch_correct else "both_wrong"


def label_of(outcome: str) -> int:
    """1 = accept the draft token (its branch is right), 0 = fall back to the target token."""
    return int(outcome in ("draft_only", "both_correct"))


@dataclass
class Judgement:
    """A judge's verdicts on one rollout: its target branch, and each judged draft branch."""

    target_branch_correct: bool
    draft_branch_correct: list[bool]


@dataclass
class JudgeCost:
    """What judging cost: draft-branch tokens generated, judge-LM tokens read, seconds."""

    branch_tokens: int = 0
    scored_tokens: int = 0
    seconds: float = 0.0


class Judge(Protocol):
    """Judges the mismatches of a batch of rollouts (one list of mismatches per rollout).

    Taking many rollouts at once lets a judge complete all their draft branches in one
    batched engine call.
    """

    cost: JudgeCost

    def judge(
        self, rollouts: Sequence[Rollout], mismatches: Sequence[Sequence[Mismatch]]
    ) -> list[Judgement]: ...


class OutcomeJudge:
    """Complete each draft branch and grade both branches with the task's grader."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cost = JudgeCost()

    def judge(
        self, rollouts: Sequence[Rollout], mismatches: Sequence[Sequence[Mismatch]]
    ) -> list[Judgement]:
        start = time.perf_counter()
        branches = complete_draft_branches(self.engine, rollouts, mismatches)
        decode = self.engine.tokenizer.decode
        judgements = [
            Judgement(rollout.item.grade(rollout.text),
                      [rollout.item.grade(decode(ids, skip_special_tokens=True))
                       for ids in completions])
            for rollout, completions in zip(rollouts, branches.completions, strict=True)
        ]
        self.cost.branch_tokens += branches.generated_tokens
        self.cost.seconds += time.perf_counter() - start
        return judgements


class ModelJudge:
    """Complete each draft branch and ask a judge LM whether each branch is right.

    The judge reads ``template`` filled with the prompt and a branch's completion text (so
    its tokenizer may differ from the target's) and compares its next-token logits of the
    first token of ``yes`` and of ``no``.
    """

    def __init__(
        self,
        engine: Engine,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        template: str = "{prompt}{completion}\nIs this answer correct? ",
        yes: str = "yes",
        no: str = "no",
        batch_size: int = 16,
    ) -> None:
        self.engine = engine
        self.model = model
        self.tokenizer = tokenizer
        self.template = template
        self.batch_size = batch_size
        self.yes_id, self.no_id = (self._first_token(word) for word in (yes, no))
        if self.yes_id == self.no_id:
            raise CoSpecError(f"judge words {yes!r} and {no!r} start with the same token; "
                              "pick words whose first tokens differ")
        self.cost = JudgeCost()

    def _first_token(self, word: str) -> int:
        ids = self.tokenizer(word, add_special_tokens=False).input_ids
        if not ids:
            raise CoSpecError(f"judge word {word!r} encodes to no token")
        return ids[0]

    @torch.inference_mode()
    def score(self, texts: Sequence[str]) -> list[float]:
        """P(yes) / (P(yes) + P(no)) of the judge's next token after each text."""
        scores: list[float] = []
        device = self.model.device
        for begin in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(list(texts[begin:begin + self.batch_size]), padding=True,
                                   padding_side="left", return_tensors="pt")
            mask = batch.attention_mask.to(device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = self.model(input_ids=batch.input_ids.to(device), attention_mask=mask,
                                position_ids=positions).logits[:, -1]
            pair = logits[:, [self.yes_id, self.no_id]].float().log_softmax(-1)
            scores += pair[:, 0].exp().tolist()
            self.cost.scored_tokens += int(mask.sum())
        return scores

    def judge(
        self, rollouts: Sequence[Rollout], mismatches: Sequence[Sequence[Mismatch]]
    ) -> list[Judgement]:
        start = time.perf_counter()
        branches = complete_draft_branches(self.engine, rollouts, mismatches)
        decode = self.engine.tokenizer.decode
        texts = []
        for rollout, completions in zip(rollouts, branches.completions, strict=True):
            texts.append(self._text(rollout, rollout.text))
            texts += [self._text(rollout, decode(ids, skip_special_tokens=True))
                      for ids in completions]
        right = [s >= 0.5 for s in self.score(texts)]
        judgements, offset = [], 0
        for completions in branches.completions:
            judgements.append(Judgement(right[offset],
                                        right[offset + 1: offset + 1 + len(completions)]))
            offset += 1 + len(completions)
        self.cost.branch_tokens += branches.generated_tokens
        self.cost.seconds += time.perf_counter() - start
        return judgements

    def _text(self, rollout: Rollout, completion: str) -> str:
        return self.template.format(prompt=rollout.item.prompt, completion=completion)
