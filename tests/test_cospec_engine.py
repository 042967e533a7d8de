"""CoSpec decoding in the engine: the arbiter's decisions at mismatches."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import PROMPTS, noisy_copy

from cospec.arbiter import ArbiterModel
from cospec.engine import Engine, EngineConfig
from cospec.errors import CoSpecError


@pytest.fixture(scope="module")
def models(tiny_llama):
    target = tiny_llama(num_layers=2, hidden_size=64, seed=1)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    drafter = noisy_copy(target, 0.05, seed=2)
    reference_drafter = copy.deepcopy(drafter)
    arbiter = ArbiterModel.from_drafter(drafter, num_draft_tokens=4)
    torch.manual_seed(0)
    with torch.no_grad():
        arbiter.head.weight.normal_(0, 0.5)
        arbiter.head.bias.fill_(0.0)
    return target, reference_drafter, arbiter


def generate(target, tokenizer, drafters, arbiter=None, **kwargs):
    config = EngineConfig(max_new_tokens=32, batch_size=8, **kwargs)
    return Engine(target, tokenizer, drafters, config, arbiter=arbiter).generate(PROMPTS)


def test_always_reject_equals_vanilla_spd(models, tokenizer):
    target, drafter, arbiter = models
    vanilla = generate(target, tokenizer, [drafter])
    rejecting = generate(target, tokenizer, [], arbiter, arbiter_mode="always_reject")
    for a, b in zip(vanilla.sequences, rejecting.sequences, strict=True):
        assert a.token_ids == b.token_ids
        assert [r.accepted for r in a.rounds] == [r.accepted for r in b.rounds]


def test_drafter_runs_without_the_adapter(models, tokenizer):
    target, drafter, arbiter = models
    alone = generate(target, tokenizer, [drafter], method="drafter")
    wrapped = generate(target, tokenizer, [], arbiter, method="drafter")
    assert [s.token_ids for s in alone.sequences] == [s.token_ids for s in wrapped.sequences]


def test_always_accept_keeps_every_draft(models, tokenizer):
    target, drafter, arbiter = models
    result = generate(target, tokenizer, [], arbiter, arbiter_mode="always_accept")
    drafted_alone = generate(target, tokenizer, [drafter], method="drafter")
    for seq, alone in zip(result.sequences, drafted_alone.sequences, strict=True):
        for r in seq.rounds[:-1]:
            assert r.accepted == 4
            assert r.next_token == r.target_tokens[4]  # the target's bonus token
        assert all(r.arbiter_decisions == [True] * len(r.mismatches) for r in seq.rounds)
        assert seq.token_ids[:4] == alone.token_ids[:4]  # the first block is the drafter's


def test_threshold_mode_walks_past_accepted_mismatches(models, tokenizer):
    target, _, arbiter = models
    result = generate(
        target, tokenizer, [], arbiter, arbiter_mode="threshold", arbiter_threshold=0.5
    )
    stats = result.stats
    assert stats.mismatches > 0 and 0 < stats.arbiter_accepts < stats.mismatches
    for seq in result.sequences:
        for r in seq.rounds:
            assert len(r.arbiter_probs) == len(r.mismatches) == len(r.arbiter_decisions)
            for j, prob, keep in zip(
                r.mismatches, r.arbiter_probs, r.arbiter_decisions, strict=True
            ):
                assert keep == (prob >= 0.5)
                assert r.draft_tokens[j] != r.target_tokens[j]
            kept_before = [
                keep
                for j, keep in zip(r.mismatches, r.arbiter_decisions, strict=True)
                if j < r.accepted
            ]
            assert all(kept_before)  # the walk only passes mismatches it accepted
            if r.accepted < 4 and len(r.tiers) > r.accepted:  # the rejection was emitted
                assert r.mismatches[-1] == r.accepted and not r.arbiter_decisions[-1]


def test_arbiter_probabilities_match_an_uncached_scoring(models, tokenizer):
    target, _, arbiter = models
    result = generate(target, tokenizer, [], arbiter, arbiter_mode="threshold")
    seq = result.sequences[2]
    context = list(seq.prompt_ids)
    for r in seq.rounds:
        ids = torch.tensor([context])
        with torch.no_grad():
            logits = arbiter.score_round(
                ids,
                torch.ones_like(ids),
                torch.arange(len(context))[None],
                None,
                torch.tensor([r.draft_tokens]),
                torch.tensor([r.target_tokens[:4]]),
            )
        probs = logits.sigmoid()[0]
        for j, p in zip(r.mismatches, r.arbiter_probs, strict=True):
            assert abs(float(probs[j]) - p) < 1e-5
        context += [*r.draft_tokens[: r.accepted], r.next_token]


def test_sample_mode_is_seeded(models, tokenizer):
    target, _, arbiter = models
    a = generate(target, tokenizer, [], arbiter, arbiter_mode="sample", seed=7)
    b = generate(target, tokenizer, [], arbiter, arbiter_mode="sample", seed=7)
    assert [s.token_ids for s in a.sequences] == [s.token_ids for s in b.sequences]
    assert a.stats.arbiter_accepts > 0


def test_arbiter_errors(models, tokenizer):
    target, drafter, arbiter = models
    with pytest.raises(CoSpecError, match="needs an arbiter model"):
        Engine(target, tokenizer, [drafter], EngineConfig(arbiter_mode="threshold"))
    with pytest.raises(CoSpecError, match="trained for K=4"):
        Engine(
            target,
            tokenizer,
            [],
            EngineConfig(arbiter_mode="threshold", num_draft_tokens=3),
            arbiter=arbiter,
        )
    with pytest.raises(CoSpecError, match="unknown arbiter_mode"):
        EngineConfig(arbiter_mode="maybe")
