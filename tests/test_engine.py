"""Engine correctness against independent references.

The reference for greedy decoding is a brute-force loop: a full forward over the whole
sequence at every step, no cache, no batching. Speculative decoding must reproduce it token
for token; sampling must reproduce the target's (warped) distribution.
"""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS, first_token_histograms, noisy_copy, reference_greedy

from cospec.engine import Engine, EngineConfig
from cospec.engine.sampling import greedy_accept, speculative_accept, warp_probs
from cospec.errors import CoSpecError


@pytest.fixture(scope="module")
def pair(tiny_llama):
    target = tiny_llama(num_layers=2, hidden_size=64, seed=1)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)  # peaky distributions, like a trained model
    return target, noisy_copy(target, 0.05, seed=2)


def run(target, drafter, tokenizer, prompts, **kwargs):
    config = EngineConfig(**kwargs)
    drafters = [drafter] if drafter is not None else []
    return Engine(target, tokenizer, drafters, config).generate(prompts)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_spd_equals_brute_force_target_greedy(pair, tokenizer, k, batch_size):
    target, drafter = pair
    max_new = 24
    result = run(target, drafter, tokenizer, PROMPTS, num_draft_tokens=k,
                 batch_size=batch_size, max_new_tokens=max_new)
    for prompt, seq in zip(PROMPTS, result.sequences, strict=True):
        ids = tokenizer(prompt).input_ids
        assert seq.token_ids == reference_greedy(target, ids, max_new, tokenizer.eos_token_id)
        assert len(seq.token_ids) == max_new  # random models never emit eos here
    stats = result.stats
    assert 0 < stats.accepted_tokens < stats.drafted_tokens  # acceptance is really ragged
    assert stats.target_forwards_per_token < 1.0


def test_eos_inside_a_block_stops_exactly(pair, tokenizer):
    target, drafter = pair
    ids = tokenizer(PROMPTS[0]).input_ids
    full = reference_greedy(target, ids, 30, eos=-1)
    eos = full[9]  # a token the target emits mid-generation acts as eos
    expected = reference_greedy(target, ids, 30, eos=eos)
    result = run(target, drafter, tokenizer, [PROMPTS[0]] * 3, num_draft_tokens=4,
                 max_new_tokens=30, eos_token_id=eos)
    for seq in result.sequences:
        assert seq.token_ids == expected
        assert seq.finish_reason == "eos"


@pytest.mark.parametrize("method", ["target", "drafter"])
def test_autoregressive_methods_equal_brute_force(pair, tokenizer, method):
    target, drafter = pair
    model = target if method == "target" else drafter
    result = run(target, drafter, tokenizer, PROMPTS[:4], method=method, max_new_tokens=12,
                 batch_size=4)
    for prompt, seq in zip(PROMPTS[:4], result.sequences, strict=True):
        ids = tokenizer(prompt).input_ids
        assert seq.token_ids == reference_greedy(model, ids, 12, tokenizer.eos_token_id)


def test_batched_equals_per_row_with_compaction(pair, tokenizer):
    target, drafter = pair
    batched = run(target, drafter, tokenizer, PROMPTS, batch_size=8, max_new_tokens=40,
                  compact_threshold=0.05)
    assert batched.stats.compactions > 0
    for prompt, seq in zip(PROMPTS, batched.sequences, strict=True):
        single = run(target, drafter, tokenizer, [prompt], batch_size=1, max_new_tokens=40)
        assert seq.token_ids == single.sequences[0].token_ids
        assert [r.accepted for r in seq.rounds] == [r.accepted for r in single.sequences[0].rounds]


def test_rows_finishing_at_different_times(pair, tokenizer):
    target, drafter = pair
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    eos = reference_greedy(target, ids[0], 30, eos=-1)[6]
    result = run(target, drafter, tokenizer, PROMPTS, batch_size=8, max_new_tokens=30,
                 eos_token_id=eos)
    for prompt_ids, seq in zip(ids, result.sequences, strict=True):
        assert seq.token_ids == reference_greedy(target, prompt_ids, 30, eos)
    assert {s.finish_reason for s in result.sequences} == {"eos", "length"}


def test_trace_is_consistent_with_output(pair, tokenizer):
    target, drafter = pair
    seq = run(target, drafter, tokenizer, [PROMPTS[2]], max_new_tokens=30).sequences[0]
    rebuilt: list[int] = []
    for r in seq.rounds:
        assert len(r.draft_tokens) == len(r.draft_probs) == len(r.target_probs) == 4
        assert r.draft_tokens[: r.accepted] == r.target_tokens[: r.accepted]
        assert r.mismatches == ([r.accepted] if r.accepted < 4 else [])
        assert r.next_token == r.target_tokens[r.accepted]
        rebuilt += [*r.draft_tokens[: r.accepted], r.next_token]
    assert rebuilt[:30] == seq.token_ids
    assert seq.mean_accepted_length == 1 + sum(r.accepted for r in seq.rounds) / len(seq.rounds)


def test_hf_assisted_generation_matches(pair, tokenizer):
    target, drafter = pair
    ours = run(target, drafter, tokenizer, [PROMPTS[0]], max_new_tokens=20).sequences[0]
    ids = torch.tensor([tokenizer(PROMPTS[0]).input_ids])
    hf = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=20,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    assert ours.token_ids == hf[0, ids.shape[1]:].tolist()


def test_stop_strings_cut_the_text(pair, tokenizer):
    target, drafter = pair
    full = run(target, drafter, tokenizer, [PROMPTS[1]], max_new_tokens=30).sequences[0]
    stop = full.text[10:12]
    seq = run(target, drafter, tokenizer, [PROMPTS[1]], max_new_tokens=30,
              stop_strings=[stop]).sequences[0]
    assert seq.finish_reason == "stop"
    assert stop in seq.text and seq.text.index(stop) + len(stop) == len(seq.text)
    assert full.token_ids[: len(seq.token_ids)] == seq.token_ids


# --- sampling ------------------------------------------------------------------------------


def test_speculative_accept_reproduces_target_distribution():
    """First emitted token of one SPD round is distributed exactly as q_1 (pure function)."""
    gen = torch.Generator().manual_seed(0)
    vocab, n = 6, 200_000
    p = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05])
    q = torch.tensor([[0.1, 0.3, 0.3, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]])
    draft = torch.multinomial(p.expand(n, vocab), 1, replacement=True, generator=gen)
    accepted, next_token = speculative_accept(draft, p.expand(n, 1, vocab),
                                              q.expand(n, 2, vocab), gen)
    first = torch.where(accepted == 1, draft[:, 0], next_token)
    hist = torch.bincount(first, minlength=vocab).float() / n
    assert torch.allclose(hist, q[0], atol=0.005)


def test_greedy_accept_rule():
    draft = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7]])
    target = torch.nn.functional.one_hot(torch.tensor([5, 6, 7, 8]), 10).float()
    accepted, next_token = greedy_accept(draft, target.expand(3, 4, 10))
    assert accepted.tolist() == [3, 1, 0]
    assert next_token.tolist() == [8, 6, 5]


def test_warp_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert warp_probs(logits, 1.0, 2, 1.0)[0].tolist() == pytest.approx([0.625, 0.375, 0, 0])
    top_p = warp_probs(logits, 1.0, 0, 0.7)[0]
    assert top_p.tolist() == pytest.approx([0.625, 0.375, 0, 0])


@pytest.mark.slow
def test_sampling_spd_matches_target_sampling(pair, tokenizer):
    target, drafter = pair
    n, positions, vocab = 3000, 3, len(tokenizer)
    prompts = [PROMPTS[0]] * n
    kwargs = dict(temperature=0.8, top_k=30, max_new_tokens=positions, batch_size=500,
                  eos_token_id=-1)
    reference = [first_token_histograms(run(target, None, tokenizer, prompts, method="target",
                                            seed=s, **kwargs), positions, vocab)
                 for s in (1, 2)]
    spd = first_token_histograms(run(target, drafter, tokenizer, prompts, seed=3,
                                     num_draft_tokens=2, **kwargs), positions, vocab)
    noise_floor = 0.5 * (reference[0] - reference[1]).abs().sum(-1)
    distance = 0.5 * (spd - reference[0]).abs().sum(-1)
    assert (distance < 1.5 * noise_floor + 0.01).all(), (distance, noise_floor)
    greedy_like = first_token_histograms(
        run(target, drafter, tokenizer, prompts, method="drafter", seed=4, **kwargs),
        positions, vocab)
    assert (0.5 * (greedy_like - reference[0]).abs().sum(-1) > 1.5 * noise_floor + 0.01).any()


# --- bad input -----------------------------------------------------------------------------


def test_bad_input_gives_clear_errors(pair, tokenizer):
    target, drafter = pair
    with pytest.raises(CoSpecError, match="num_draft_tokens"):
        EngineConfig(num_draft_tokens=0)
    with pytest.raises(CoSpecError, match="max_new_tokens"):
        EngineConfig(max_new_tokens=0)
    with pytest.raises(CoSpecError, match="unknown method"):
        EngineConfig(method="beam")
    engine = Engine(target, tokenizer, [drafter], EngineConfig())
    with pytest.raises(CoSpecError, match="prompt 1 is empty"):
        engine.generate(["Q: a", "  "])
    with pytest.raises(CoSpecError, match="no prompts"):
        engine.generate([])
    with pytest.raises(CoSpecError, match="needs at least one drafter"):
        Engine(target, tokenizer, [], EngineConfig(method="spd"))
