"""VIA-SD: the three tiers, checked against hand-worked examples and brute-force decoding.

- ``slim_tiers`` on hand-built distributions, and against a per-token loop of SPEC 2.4.
- The engine with a slim verifier against a brute-force VIA-SD decode (full forwards of
  drafter, slim verifier and target on the whole sequence, no cache, no batching).
- Exactness anchors: a slim verifier that never settles anything reproduces vanilla SPD;
  the mask that skips nothing with alpha_accept = 1 reproduces target greedy decoding.
- The toy world: a saved mask loads through ``from_pretrained`` and tiers 1-2 save target
  forwards; the ``cospec dimr`` command line.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import PROMPTS as ENGINE_PROMPTS
from helpers import brute_force_greedy

from cospec import dimr_cli
from cospec.engine import Engine, EngineConfig
from cospec.engine.sampling import slim_tiers
from cospec.engine.trace import TIER_SLIM_ACCEPT, TIER_SLIM_REGENERATE, TIER_TARGET
from cospec.errors import CoSpecError
from cospec.slim import RoutingMask, build_slim_verifier

PROMPTS = ENGINE_PROMPTS[:6]
# Layer 1 MLP and layer 2 attention of 4 layers: a slim verifier that really differs.
SOME_SKIPS = RoutingMask([False, False, True, False], [False, True, False, False])
MAX_NEW = 30


# --- slim_tiers on hand-built distributions ---------------------------------------------


def _tiers(draft, rows, alpha_accept, alpha_regen):
    """``slim_tiers`` on one row given as a list of K+1 distributions."""
    probs = torch.tensor([rows], dtype=torch.float32)
    accepted, settled, tokens = slim_tiers(torch.tensor([draft]), probs, alpha_accept, alpha_regen)
    return int(accepted[0]), bool(settled[0]), tokens[0].tolist()


def test_tier1_run_then_tier3_when_the_slim_verifier_is_unsure():
    # r = 1, then r = 0.4 / 0.5 = 0.8 >= 0.8, then r = 0.1 / 0.3 < 0.8 with max 0.3 < 0.6.
    rows = [
        [0.7, 0.1, 0.1, 0.1],
        [0.1, 0.4, 0.0, 0.5],
        [0.3, 0.3, 0.1, 0.3],
        [0.25, 0.25, 0.25, 0.25],
    ]
    accepted, settled, _ = _tiers([0, 1, 2], rows, alpha_accept=0.8, alpha_regen=0.6)
    assert (accepted, settled) == (2, False)


def test_tier2_regenerates_at_the_first_failure_and_ends_the_block():
    # d_2 = 1 has r = 0.1 / 0.7; max q' = 0.7 >= 0.6: tier 2 emits argmax q'_2 = 3. The
    # confident-looking q'_3 after it plays no part: the block ends at the regeneration.
    rows = [[0.7, 0.1, 0.1, 0.1], [0.0, 0.1, 0.2, 0.7], [0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    accepted, settled, tokens = _tiers([0, 1, 2], rows, alpha_accept=0.8, alpha_regen=0.6)
    assert (accepted, settled, tokens[accepted]) == (1, True, 3)


def test_first_token_can_escalate_to_tier3():
    rows = [[0.4, 0.3, 0.2, 0.1], [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    accepted, settled, _ = _tiers([3, 0, 0], rows, alpha_accept=0.8, alpha_regen=0.6)
    assert (accepted, settled) == (0, False)


def test_whole_block_in_tier1_takes_the_slim_bonus_only_when_confident():
    # Every r >= 0.8, so all drafts pass tier 1. The bonus is argmax q'_4 = 2 in tier 2 only
    # if max q'_4 reaches alpha_regen; at 0.3 < 0.6 the target gives the bonus (tier 3).
    rows = [
        [0.7, 0.1, 0.1, 0.1],
        [0.1, 0.45, 0.45, 0.0],
        [0.0, 0.5, 0.45, 0.05],
        [0.25, 0.2, 0.3, 0.25],
    ]
    assert _tiers([0, 2, 2], rows, alpha_accept=0.8, alpha_regen=0.6)[:2] == (3, False)
    accepted, settled, tokens = _tiers([0, 2, 2], rows, alpha_accept=0.8, alpha_regen=0.3)
    assert (accepted, settled, tokens[3]) == (3, True, 2)


def test_thresholds_are_inclusive():
    # r = 0.25 / 0.5 = 0.5 exactly passes alpha_accept = 0.5; at d_2, r = 0.25 < 0.5 and
    # max q' = 0.5 exactly reaches alpha_regen = 0.5. Binary fractions: no rounding.
    rows = [[0.5, 0.25, 0.25, 0.0], [0.125, 0.125, 0.25, 0.5], [1.0, 0.0, 0.0, 0.0]]
    assert _tiers([1, 0], rows, 0.5, 0.5) == (1, True, [0, 3, 0])
    assert _tiers([1, 0], rows, 0.5, 0.625) == (1, False, [0, 3, 0])


def _reference_tiers(draft, probs, alpha_accept, alpha_regen):
    """SPEC 2.4 read token by token, in plain Python."""
    k = len(draft)
    for j in range(k + 1):
        q = probs[j]
        top = max(q)
        if j < k and q[draft[j]] / top >= alpha_accept:
            continue
        return j, top >= alpha_regen
    raise AssertionError("unreachable")


@pytest.mark.parametrize("alphas", [(0.0, 0.0), (0.5, 0.7), (0.9, 0.9), (1.0, 1.0)])
def test_slim_tiers_matches_a_per_token_loop(alphas):
    generator = torch.Generator().manual_seed(0)
    batch, k, vocab = 64, 5, 6
    # Peaky random distributions, and drafts that are often the argmax: every tier occurs.
    probs = (3 * torch.randn(batch, k + 1, vocab, generator=generator)).softmax(-1)
    draft = torch.where(
        torch.rand(batch, k, generator=generator) < 0.7,
        probs[:, :k].argmax(-1),
        torch.randint(0, vocab, (batch, k), generator=generator),
    )
    accepted, settled, tokens = slim_tiers(draft, probs, *alphas)
    for row in range(batch):
        expected = _reference_tiers(draft[row].tolist(), probs[row].tolist(), *alphas)
        assert (int(accepted[row]), bool(settled[row])) == expected
    assert torch.equal(tokens, probs.argmax(-1))


# --- the engine against brute-force decoding ----------------------------------------------


@pytest.fixture(scope="module")
def models(tiny_llama):
    """A peaky 4-layer random target and a noisy copy of it as the drafter."""
    target = tiny_llama(num_layers=4, hidden_size=64, seed=1)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    torch.manual_seed(2)
    drafter = copy.deepcopy(target)
    with torch.no_grad():
        for param in drafter.parameters():
            param.add_(0.05 * torch.randn_like(param) * param.std())
    return target, drafter


def run(target, drafter, tokenizer, prompts, slim=None, **kwargs):
    config = EngineConfig(max_new_tokens=MAX_NEW, **kwargs)
    return Engine(target, tokenizer, [drafter], config, slim_verifier=slim).generate(prompts)


@torch.no_grad()
def _next(model, ids: list[int]) -> torch.Tensor:
    """Next-token distribution after ``ids``: a full forward, no cache."""
    return model(input_ids=torch.tensor([ids])).logits[0, -1].float().softmax(-1)


_REFERENCE_CACHE: dict[tuple, tuple] = {}


def brute_force_viasd(drafter, slim, target, ids, k, alpha_accept, alpha_regen, eos):
    """Greedy VIA-SD by the SPEC's words: returns the output, tiers per round, target rounds."""
    key = (tuple(ids), k, alpha_accept, alpha_regen, eos)
    if key not in _REFERENCE_CACHE:
        _REFERENCE_CACHE[key] = _brute_force_viasd(
            drafter, slim, target, ids, k, alpha_accept, alpha_regen, eos
        )
    return _REFERENCE_CACHE[key]


def _brute_force_viasd(drafter, slim, target, ids, k, alpha_accept, alpha_regen, eos):
    out: list[int] = []
    rounds: list[list[int]] = []
    target_rounds = 0
    while len(out) < MAX_NEW and eos not in out:
        context = ids + out
        draft: list[int] = []
        for _ in range(k):
            draft.append(int(_next(drafter, context + draft).argmax()))
        emitted, tiers = [], []
        for j in range(k + 1):
            q = _next(slim, context + draft[:j])
            if j < k and q[draft[j]] / q.max() >= alpha_accept:
                emitted.append(draft[j])
                tiers.append(TIER_SLIM_ACCEPT)
                continue
            if q.max() >= alpha_regen:
                emitted.append(int(q.argmax()))
                tiers.append(TIER_SLIM_REGENERATE)
                break
            target_rounds += 1
            for i in range(j, k + 1):
                emitted.append(int(_next(target, context + draft[:i]).argmax()))
                tiers.append(TIER_TARGET)
                if i == k or emitted[-1] != draft[i]:
                    break
            break
        emitted = emitted[: MAX_NEW - len(out)]
        if eos in emitted:
            emitted = emitted[: emitted.index(eos) + 1]
        out += emitted
        rounds.append(tiers[: len(emitted)])
    return out, rounds, target_rounds


@pytest.mark.parametrize(("alpha_accept", "alpha_regen"), [(0.9, 0.9), (0.8, 0.6)])
@pytest.mark.parametrize("batch_size", [1, 6])
def test_engine_matches_brute_force_viasd(models, tokenizer, alpha_accept, alpha_regen, batch_size):
    target, drafter = models
    slim = build_slim_verifier(target, SOME_SKIPS)
    result = run(
        target,
        drafter,
        tokenizer,
        PROMPTS,
        slim,
        batch_size=batch_size,
        alpha_accept=alpha_accept,
        alpha_regen=alpha_regen,
        compact_threshold=0.05,
    )
    total_target_rounds = 0
    for prompt, seq in zip(PROMPTS, result.sequences, strict=True):
        out, rounds, target_rounds = brute_force_viasd(
            drafter,
            slim,
            target,
            tokenizer(prompt).input_ids,
            4,
            alpha_accept,
            alpha_regen,
            tokenizer.eos_token_id,
        )
        assert seq.token_ids == out
        assert [r.tiers for r in seq.rounds] == rounds
        total_target_rounds += target_rounds
    stats = result.stats
    assert stats.target_row_forwards == total_target_rounds
    assert sum(stats.tokens_per_tier.values()) == stats.emitted_tokens
    assert set(stats.tokens_per_tier) == {TIER_SLIM_ACCEPT, TIER_SLIM_REGENERATE, TIER_TARGET}
    assert stats.target_row_forwards < stats.rounds  # tiers 1-2 settled whole blocks
    if batch_size == 1:
        assert stats.slim_calls == stats.rounds
        assert stats.target_calls == stats.target_row_forwards
    else:
        assert stats.compactions > 0  # the slim verifier's cache was compacted too


def test_mask_that_skips_nothing_with_alpha_accept_one_is_target_greedy(models, tokenizer):
    """The slim verifier is then the target: tier 1 accepts exactly d_j == argmax q (ties
    are measure zero in fp32) and tiers 2-3 emit argmax q, so decoding is lossless."""
    target, drafter = models
    slim = build_slim_verifier(target, RoutingMask.none(4))
    eos = tokenizer.eos_token_id
    expected = [brute_force_greedy(target, tokenizer(p).input_ids, MAX_NEW, eos) for p in PROMPTS]
    for alpha_regen, batch_size in [(0.0, 6), (0.5, 1), (0.9, 6), (1.0, 3)]:
        result = run(
            target,
            drafter,
            tokenizer,
            PROMPTS,
            slim,
            batch_size=batch_size,
            alpha_accept=1.0,
            alpha_regen=alpha_regen,
        )
        assert [s.token_ids for s in result.sequences] == expected
        tiers = result.stats.tokens_per_tier
        assert tiers[TIER_SLIM_ACCEPT] > 0
        # max q' reaches 1.0 only on an exact one-hot: then tier 2 never fires.
        assert (tiers.get(TIER_SLIM_REGENERATE, 0) > 0) == (alpha_regen < 1.0)
        assert (TIER_TARGET in tiers) == (alpha_regen > 0)
        # alpha_regen = 1: nothing settles in tiers 1-2, so every round asks the target.
        assert (result.stats.target_row_forwards < result.stats.rounds) == (alpha_regen < 1.0)




def test_thresholds_above_one_send_everything_to_tier3(models, tokenizer):
    """alpha > 1 turns tiers 1-2 off: VIA-SD must then be vanilla SPD exactly, round for
    round, with every token verified by the target."""
    target, drafter = models
    slim = build_slim_verifier(target, SOME_SKIPS)
    for batch_size in (1, 6):
        spd = run(target, drafter, tokenizer, PROMPTS, batch_size=batch_size)
        viasd = run(target, drafter, tokenizer, PROMPTS, slim, batch_size=batch_size,
                    alpha_accept=1.01, alpha_regen=1.01)
        for a, b in zip(spd.sequences, viasd.sequences, strict=True):
            assert a.token_ids == b.token_ids
            assert [r.accepted for r in a.rounds] == [r.accepted for r in b.rounds]
            assert all(set(r.tiers) == {TIER_TARGET} for r in b.rounds)
        assert viasd.stats.target_row_forwards == spd.stats.target_row_forwards
        assert viasd.stats.target_calls == spd.stats.target_calls
        assert viasd.stats.tokens_per_tier == {TIER_TARGET: spd.stats.emitted_tokens}


def test_batched_equals_per_row_with_a_slim_verifier(models, tokenizer):
    target, drafter = models
    slim = build_slim_verifier(target, SOME_SKIPS)
    batched = run(
        target,
        drafter,
        tokenizer,
        PROMPTS,
        slim,
        batch_size=6,
        compact_threshold=0.05,
        alpha_accept=0.8,
        alpha_regen=0.6,
    )
    assert batched.stats.compactions > 0
    for prompt, seq in zip(PROMPTS, batched.sequences, strict=True):
        single = run(
            target,
            drafter,
            tokenizer,
            [prompt],
            slim,
            batch_size=1,
            alpha_accept=0.8,
            alpha_regen=0.6,
        ).sequences[0]
        assert seq.token_ids == single.token_ids
        assert [r.tiers for r in seq.rounds] == [r.tiers for r in single.rounds]
        assert [r.accepted for r in seq.rounds] == [r.accepted for r in single.rounds]


def test_slim_verifier_needs_speculative_decoding(models, tokenizer):
    target, drafter = models
    slim = build_slim_verifier(target, SOME_SKIPS)
    with pytest.raises(CoSpecError, match="slim verifier needs method 'spd'"):
        Engine(target, tokenizer, [drafter], EngineConfig(method="target"), slim_verifier=slim)


# --- the toy world ------------------------------------------------------------------------


def test_toy_world_mask_file_loads_and_tiers_save_target_forwards(tmp_path):
    from cospec.models import load_model, load_tokenizer
    from cospec.toy import tasks

    mask = RoutingMask([False, True, False, False], [False, False, False, False], "toy:target")
    mask.save(tmp_path / "mask.json")
    config = EngineConfig(max_new_tokens=48, batch_size=1, alpha_accept=0.9, alpha_regen=0.9)
    prompts = [p.prompt for p in tasks.generate("math", "test", 4, seed=0)]
    loaded = Engine.from_pretrained(
        "toy:target", ["toy:drafter_math"], config, slim_verifier_mask=str(tmp_path / "mask.json")
    )
    result = loaded.generate(prompts)
    target = load_model("toy:target")
    built = Engine(
        target,
        load_tokenizer("toy:target"),
        [load_model("toy:drafter_math")],
        config,
        slim_verifier=build_slim_verifier(target, mask),
    ).generate(prompts)
    assert [s.token_ids for s in result.sequences] == [s.token_ids for s in built.sequences]
    stats = result.stats
    assert sum(stats.tokens_per_tier.values()) == stats.emitted_tokens
    assert stats.slim_calls == stats.rounds
    assert stats.target_row_forwards < stats.rounds / 2  # a trained target: tiers 1-2 dominate
    for seq in result.sequences:
        for r in seq.rounds:  # a tier-1 prefix, then one tier-2 token or a tier-3 tail
            assert r.tiers == sorted(r.tiers) and r.tiers.count(TIER_SLIM_REGENERATE) <= 1


# --- cospec dimr ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tiny_llama, tokenizer):
    path = tmp_path_factory.mktemp("model")
    tiny_llama(num_layers=4, hidden_size=32, seed=3).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_dimr_cli_writes_a_mask_the_engine_loads(saved_model, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Q: Tom has 3 apples.\\nA:"}\nQ: Hi\\nA:\n\n')
    out = tmp_path / "dimr"
    result = dimr_cli.main(
        [
            "--model",
            str(saved_model),
            "--prompts-file",
            str(prompts),
            "--skip-ratio",
            "0.25",
            "--n-trials",
            "3",
            "--n-startup-trials",
            "2",
            "--calibration-max-new-tokens",
            "8",
            "--output-dir",
            str(out),
            "--device",
            "cpu",
        ]
    )
    printed = capsys.readouterr().out
    assert "calibration: 2 prompts" in printed and "KL(target || slim)" in printed
    saved = RoutingMask.load(out / "mask.json")
    assert saved == result.mask and saved.num_skipped == 2
    assert saved.model == str(saved_model)
    assert json.loads((out / "report.json").read_text())["trials_total"] == 3
    engine = Engine.from_pretrained(
        str(saved_model),
        [str(saved_model)],
        EngineConfig(max_new_tokens=4),
        slim_verifier_mask=str(out / "mask.json"),
    )
    assert engine.generate(["Q: Hi\nA:"]).stats.slim_calls > 0


def test_dimr_cli_toy_prompts_come_from_the_training_split():
    from cospec.toy import tasks

    prompts = dimr_cli.toy_prompts(None, 5, seed=0)
    assert len(prompts) == 5
    questions = {p.removeprefix("Q: ").removesuffix("\nA:") for p in prompts}
    assert {tasks.split_of(q) for q in questions} == {"train"}
    assert any(q.startswith("Reverse") or "word" in q or "letters" in q for q in questions)
    assert len(dimr_cli.toy_prompts("math", 3, seed=0)) == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompts-file", "/nonexistent/prompts.txt"], "does not exist"),
        (["--model", "/nonexistent/model"], "does not exist"),
        (["--skip-ratio", "0"], "skip_ratio must be in"),
        (["--n-trials", "0"], "n_trials must be at least 1"),
    ],
)
def test_dimr_cli_errors_are_cospec_errors(argv, message, tmp_path):
    with pytest.raises(CoSpecError, match=message):
        dimr_cli.main([*argv, "--output-dir", str(tmp_path)])


def test_dimr_cli_refuses_a_bad_prompts_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(CoSpecError, match="needs a string 'prompt'"):
        dimr_cli.read_prompts(str(bad))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(CoSpecError, match="holds no prompts"):
        dimr_cli.read_prompts(str(tmp_path / "empty.txt"))
