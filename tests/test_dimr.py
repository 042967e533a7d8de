"""DIMR: the divergence it minimises, the calibration text, and the resumable mask search."""

from __future__ import annotations

import copy
import json
import statistics

import optuna
import pytest
import torch
import torch.nn.functional as F

from cospec import dimr
from cospec.dimr import (
    DimrConfig,
    calibration_batch,
    candidate_sublayers,
    num_to_skip,
    random_masks_divergence,
    run_dimr,
    slim_divergence,
)
from cospec.errors import CoSpecError
from cospec.slim import RoutingMask, build_slim_verifier

PROMPTS = ["12 + 5 =", "reverse abc", "3*4+1", "cap xyz"]


def _padded_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (3, 10), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, 8:] = 0  # right padding after an EOS, as calibration_batch produces
    return ids, mask


@torch.no_grad()
def _brute_force_divergence(target, slim, ids, mask) -> tuple[float, float]:
    """Row by row on the unpadded tokens, with torch's own kl_div: no shared code path."""
    kls, agreements = [], []
    for row_ids, row_mask in zip(ids, mask, strict=True):
        tokens = row_ids[row_mask.bool()][None]
        q = F.log_softmax(target(tokens).logits[0].double(), dim=-1)
        q_slim = F.log_softmax(slim(tokens).logits[0].double(), dim=-1)
        for position in range(tokens.shape[1]):
            kl = F.kl_div(q_slim[position], q[position], log_target=True, reduction="sum")
            kls.append(kl.item())
            agreements.append(float(q[position].argmax() == q_slim[position].argmax()))
    return statistics.mean(kls), statistics.mean(agreements)


def test_divergence_is_zero_for_the_mask_that_skips_nothing(tiny_llama):
    target = tiny_llama(num_layers=4)
    ids, mask = _padded_batch(target.config.vocab_size)
    result = slim_divergence(target, build_slim_verifier(target, RoutingMask.none(4)), ids, mask)
    assert result.kl == 0
    assert result.greedy_agreement == 1


def test_divergence_matches_brute_force_kl(tiny_llama):
    target = tiny_llama(num_layers=4)
    ids, mask = _padded_batch(target.config.vocab_size)
    slim = build_slim_verifier(
        target, RoutingMask([False, True, False, False], [False, True, True, False])
    )
    result = slim_divergence(target, slim, ids, mask)
    expected_kl, expected_agreement = _brute_force_divergence(target, slim, ids, mask)
    assert result.kl > 0
    assert result.kl == pytest.approx(expected_kl, rel=1e-4)
    assert result.greedy_agreement == pytest.approx(expected_agreement)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("skip_ratio", 0.0, "skip_ratio"),
        ("skip_ratio", 0.95, "skip_ratio"),
        ("n_trials", 0, "n_trials"),
        ("n_startup_trials", -1, "n_startup_trials"),
        ("timeout_s", 0, "timeout_s"),
        ("calibration_prompts", 0, "calibration_prompts"),
        ("calibration_max_new_tokens", 0, "calibration_max_new_tokens"),
    ],
)
def test_config_refuses_bad_values(field, value, message):
    with pytest.raises(CoSpecError, match=message):
        DimrConfig(**{field: value})


def test_search_space_excludes_first_and_last_layer(tiny_llama):
    target = tiny_llama(num_layers=6)
    candidates = candidate_sublayers(target)
    assert sorted(candidates) == [(i, kind) for i in range(1, 5) for kind in ("attention", "mlp")]
    assert num_to_skip(target, 0.35) == 4  # round(0.35 * 12)
    assert num_to_skip(target, 0.9) == 8  # clipped to the 8 candidates
    with pytest.raises(CoSpecError, match="skips no sublayer"):
        num_to_skip(tiny_llama(num_layers=2), 0.45)


@torch.no_grad()
def _greedy_reference(target, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    """Argmax continuation of one unpadded prompt, full forward per step, stopping at EOS."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = target(ids).logits[0, -1].argmax().item()
        generated.append(token)
        if token == tokenizer.eos_token_id:
            break
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return generated


def test_calibration_batch_is_the_targets_greedy_continuation(tiny_llama, tokenizer):
    target = tiny_llama(num_layers=2)
    # Make the token row 0 generates third the EOS, so that row stops early and the
    # tokens generated after it must be masked out.
    free_run = _greedy_reference(target, tokenizer, PROMPTS[0], 8)
    eos_tokenizer = copy.deepcopy(tokenizer)
    eos_tokenizer.eos_token = tokenizer.convert_ids_to_tokens(free_run[2])

    ids, mask = calibration_batch(target, eos_tokenizer, PROMPTS, max_new_tokens=8)
    stopped_early = False
    for row, prompt in enumerate(PROMPTS):
        prompt_ids = eos_tokenizer(prompt)["input_ids"]
        row_ids = ids[row][mask[row].bool()].tolist()
        expected = _greedy_reference(target, eos_tokenizer, prompt, 8)
        assert row_ids == prompt_ids + expected
        stopped_early |= len(expected) < 8
    assert stopped_early


def test_random_masks_have_the_ratio_and_are_seeded(tiny_llama):
    target = tiny_llama(num_layers=6)
    ids, mask = _padded_batch(target.config.vocab_size)
    first = random_masks_divergence(target, ids, mask, skip_ratio=0.35, n=4, seed=3)
    assert first == random_masks_divergence(target, ids, mask, skip_ratio=0.35, n=4, seed=3)
    assert len(first) == 4
    assert all(kl > 0 for kl in first)


def test_dimr_finds_a_mask_better_than_random_ones(tiny_llama, tmp_path):
    target = tiny_llama(num_layers=6, seed=1)
    ids, mask = _padded_batch(target.config.vocab_size)
    config = DimrConfig(
        model="tiny",
        skip_ratio=0.35,
        n_trials=16,
        n_startup_trials=6,
        seed=0,
        output_dir=str(tmp_path),
    )
    result = run_dimr(config, target, ids, mask)

    assert result.mask.num_skipped == 4
    assert result.trials_run == result.trials_total == 16
    random_kls = random_masks_divergence(target, ids, mask, 0.35, n=16, seed=0)
    assert result.kl <= statistics.mean(random_kls)

    saved = RoutingMask.load(tmp_path / "mask.json")
    assert saved == result.mask
    assert saved.model == "tiny"
    recomputed = slim_divergence(target, build_slim_verifier(target, saved), ids, mask)
    assert recomputed.kl == pytest.approx(result.kl)
    assert recomputed.greedy_agreement == pytest.approx(result.greedy_agreement)

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["kl"] == pytest.approx(result.kl)
    assert report["best_trial"] == result.best_trial
    assert report["trials_total"] == 16
    assert report["skipped"] == saved.skipped_names()
    assert report["time_ratio"] > 0


def test_dimr_resumes_without_redoing_trials(tiny_llama, tmp_path):
    target = tiny_llama(num_layers=4)
    ids, mask = _padded_batch(target.config.vocab_size)

    def config(n_trials: int, skip_ratio: float = 0.25) -> DimrConfig:
        return DimrConfig(
            skip_ratio=skip_ratio, n_trials=n_trials, n_startup_trials=2, output_dir=str(tmp_path)
        )

    assert run_dimr(config(4), target, ids, mask).trials_run == 4
    second = run_dimr(config(7), target, ids, mask)
    assert (second.trials_run, second.trials_total) == (3, 7)
    assert run_dimr(config(7), target, ids, mask).trials_run == 0
    study = optuna.load_study(study_name="dimr", storage=f"sqlite:///{tmp_path / 'dimr.db'}")
    assert len(study.trials) == 7

    with pytest.raises(CoSpecError, match="another model, skip ratio or calibration"):
        run_dimr(config(8, skip_ratio=0.5), target, ids, mask)


def test_identical_masks_are_evaluated_once(tiny_llama, tmp_path, monkeypatch):
    """4 layers at ratio 0.25: skip 2 of 4 candidates, so only 6 distinct masks exist."""
    target = tiny_llama(num_layers=4)
    ids, mask = _padded_batch(target.config.vocab_size)
    built = []

    def counting_build(model, routing_mask):
        built.append(tuple(routing_mask.skipped_names()))
        return build_slim_verifier(model, routing_mask)

    monkeypatch.setattr(dimr, "build_slim_verifier", counting_build)
    config = DimrConfig(
        skip_ratio=0.25,
        n_trials=14,
        n_startup_trials=4,
        sensitivity_warm_start=False,
        output_dir=str(tmp_path),
    )
    run_dimr(config, target, ids, mask)
    searched = built[:-1]  # the last build times the best mask
    assert len(searched) == len(set(searched)) <= 6


def test_warm_start_trial_skips_the_least_sensitive_sublayers(tiny_llama, tmp_path):
    target = tiny_llama(num_layers=6, seed=2)
    ids, mask = _padded_batch(target.config.vocab_size)
    config = DimrConfig(skip_ratio=0.25, n_trials=1, output_dir=str(tmp_path))
    result = run_dimr(config, target, ids, mask)

    def alone(layer: int, kind: str) -> float:
        routing_mask = RoutingMask.none(6)
        (routing_mask.skip_attention if kind == "attention" else routing_mask.skip_mlp)[layer] = (
            True
        )
        return slim_divergence(target, build_slim_verifier(target, routing_mask), ids, mask).kl

    least_harmful = sorted(candidate_sublayers(target), key=lambda c: alone(*c))[:3]
    assert set(result.mask.skipped_names()) == {f"{layer}.{kind}" for layer, kind in least_harmful}
