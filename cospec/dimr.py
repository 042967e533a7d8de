"""DIMR: the offline search for the slim verifier's routing mask.

At a fixed skip ratio, choose which attention and MLP sublayers to skip so that the slim
verifier's next-token distributions stay closest (in KL) to the target's on target-generated
calibration text. Random search explores first, then Bayesian optimisation (optuna's TPE)
exploits. A trial suggests one score per candidate sublayer and skips the n highest, so
every trial skips exactly n sublayers and the sampler still works in a fixed-size space.
The first trial is, by default, a warm start: the n sublayers that hurt least when skipped
alone.

The study lives in SQLite under the output directory: a re-run continues it and only runs
the trials still missing, and the target's log-probabilities are the only state rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import optuna
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from cospec.errors import CoSpecError
from cospec.slim import RoutingMask, attention_anchor_layers, build_slim_verifier, decoder_layers

STUDY_NAME = "dimr"
MAX_SKIP_RATIO = 0.9
TIMING_REPEATS = 3


@dataclass
class DimrConfig:
    """Settings of one DIMR search."""

    model: str = field(
        default="toy:target",
        metadata={"help": "Target model (path, Hub id or toy:NAME); recorded in mask.json."},
    )
    skip_ratio: float = field(
        default=0.45,
        metadata={
            "help": "Share of all sublayers (2 per layer) to skip, in (0, 0.9]. The "
            "published setup skips about 45%."
        },
    )
    n_trials: int = field(
        default=200,
        metadata={"help": "Total trials of the study, counting those of earlier runs."},
    )
    timeout_s: float | None = field(
        default=None,
        metadata={
            "help": "Stop this run after this many seconds (None: no limit); a re-run "
            "resumes the study."
        },
    )
    n_startup_trials: int = field(
        default=20,
        metadata={"help": "Random-search trials before Bayesian optimisation (TPE) takes over."},
    )
    sensitivity_warm_start: bool = field(
        default=True,
        metadata={
            "help": "Before searching, measure each candidate skipped alone and make the "
            "first trial skip the n least harmful ones (one forward per candidate)."
        },
    )
    seed: int = field(default=0, metadata={"help": "Seed of the samplers."})
    output_dir: str = field(
        default="outputs/dimr",
        metadata={"help": "Where the study (dimr.db), mask.json and report.json are written."},
    )
    calibration_prompts: int = field(
        default=32,
        metadata={"help": "Number of prompts the target continues to make calibration text."},
    )
    calibration_max_new_tokens: int = field(
        default=128,
        metadata={"help": "Tokens the target generates (greedy) per calibration prompt."},
    )

    def __post_init__(self) -> None:
        if not 0 < self.skip_ratio <= MAX_SKIP_RATIO:
            raise CoSpecError(f"skip_ratio must be in (0, {MAX_SKIP_RATIO}], got {self.skip_ratio}")
        if self.n_trials < 1:
            raise CoSpecError(f"n_trials must be at least 1, got {self.n_trials}")
        if self.n_startup_trials < 0:
            raise CoSpecError(f"n_startup_trials must be >= 0, got {self.n_startup_trials}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise CoSpecError(f"timeout_s must be positive or None, got {self.timeout_s}")
        if self.calibration_prompts < 1:
            raise CoSpecError(
                f"calibration_prompts must be at least 1, got {self.calibration_prompts}"
            )
        if self.calibration_max_new_tokens < 1:
            raise CoSpecError(
                "calibration_max_new_tokens must be at least 1, got "
                f"{self.calibration_max_new_tokens}"
            )
        if not self.output_dir:
            raise CoSpecError("output_dir must not be empty")


@dataclass
class SlimDivergence:
    """How far the slim verifier's next-token distributions are from the target's."""

    kl: float
    """Mean over valid positions of KL(q || q'), q the target's and q' the slim verifier's."""
    greedy_agreement: float
    """Share of valid positions where both argmaxes agree."""


@dataclass
class DimrResult:
    """The best mask of a study and what was measured for it."""

    mask: RoutingMask
    kl: float
    greedy_agreement: float
    time_ratio: float
    """Slim forward time over target forward time on the calibration batch."""
    trials_run: int
    """Trials this call ran (a resumed study ran the others earlier)."""
    trials_total: int
    best_trial: int


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding, so a padded row reads like an unpadded one."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def _log_probs(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """fp32 next-token log-probabilities at the valid positions, flattened to (N, vocab)."""
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_for(attention_mask),
        use_cache=False,
    ).logits
    return torch.log_softmax(logits[attention_mask.bool()].float(), dim=-1)


def _divergence(target_log_probs: torch.Tensor, slim_log_probs: torch.Tensor) -> SlimDivergence:
    kl = (target_log_probs.exp() * (target_log_probs - slim_log_probs)).sum(-1)
    agree = target_log_probs.argmax(-1) == slim_log_probs.argmax(-1)
    return SlimDivergence(kl=kl.mean().item(), greedy_agreement=agree.float().mean().item())


def slim_divergence(
    target: PreTrainedModel,
    slim: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
) -> SlimDivergence:
    """KL(q || q') and greedy agreement, teacher-forced on ``input_ids`` (one forward each)."""
    return _divergence(
        _log_probs(target, input_ids, attention_mask),
        _log_probs(slim, input_ids, attention_mask),
    )


@torch.no_grad()
def calibration_batch(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    max_new_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts continued greedily by the target: the text DIMR measures divergence on.

    Returns ids and attention mask. Generated tokens after a row's first EOS are padding
    (masked out), whatever the pad token is.
    """
    if not prompts:
        raise CoSpecError("calibration needs at least one prompt")
    device = next(target.parameters()).device
    encoded = tokenizer(list(prompts), return_tensors="pt", padding=True, padding_side="left")
    prompt_ids = encoded["input_ids"].to(device)
    prompt_mask = encoded["attention_mask"].to(device)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id
    sequences = target.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_id,
    )
    generated = sequences[:, prompt_ids.shape[1] :]
    is_eos = generated == tokenizer.eos_token_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return sequences, torch.cat([prompt_mask, (~after_eos).long()], dim=1)


def candidate_sublayers(target: PreTrainedModel) -> list[tuple[int, str]]:
    """Sublayers DIMR may skip: attention and MLP of layers 1..L-2, minus attention anchors."""
    num_layers = len(decoder_layers(target))
    anchors = attention_anchor_layers(target.config)
    inner = range(1, num_layers - 1)
    return [(i, "attention") for i in inner if i not in anchors] + [(i, "mlp") for i in inner]


def num_to_skip(target: PreTrainedModel, skip_ratio: float) -> int:
    """round(skip_ratio * 2L), clipped to the candidates; an error if that skips nothing."""
    num_layers = len(decoder_layers(target))
    n = min(round(skip_ratio * 2 * num_layers), len(candidate_sublayers(target)))
    if n < 1:
        raise CoSpecError(
            f"skip_ratio {skip_ratio} skips no sublayer of a {num_layers}-layer model; raise it"
        )
    return n


def mask_from_skipped(
    num_layers: int, skipped: Sequence[tuple[int, str]], model: str | None = None
) -> RoutingMask:
    """The mask skipping exactly ``skipped``, given as ``(layer, "attention" | "mlp")``."""
    mask = RoutingMask.none(num_layers, model)
    for layer, kind in skipped:
        (mask.skip_attention if kind == "attention" else mask.skip_mlp)[layer] = True
    return mask


def random_masks_divergence(
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    skip_ratio: float,
    n: int,
    seed: int,
) -> list[float]:
    """KL of ``n`` uniformly random masks at DIMR's skip ratio: the baseline DIMR must beat."""
    candidates = candidate_sublayers(target)
    num_skip = num_to_skip(target, skip_ratio)
    rng = random.Random(seed)
    target_log_probs = _log_probs(target, input_ids, attention_mask)
    return [
        _skipped_divergence(
            target, target_log_probs, rng.sample(candidates, num_skip), input_ids, attention_mask
        ).kl
        for _ in range(n)
    ]


def _skipped_divergence(
    target: PreTrainedModel,
    target_log_probs: torch.Tensor,
    skipped: Sequence[tuple[int, str]],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
) -> SlimDivergence:
    """Divergence of the slim verifier skipping ``skipped``, against cached target log-probs."""
    mask = mask_from_skipped(len(decoder_layers(target)), skipped)
    slim = build_slim_verifier(target, mask)
    return _divergence(target_log_probs, _log_probs(slim, input_ids, attention_mask))


def _param_name(candidate: tuple[int, str]) -> str:
    layer, kind = candidate
    return f"score_{layer}_{kind}"


def _sensitivity_scores(
    target: PreTrainedModel,
    target_log_probs: torch.Tensor,
    candidates: Sequence[tuple[int, str]],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
) -> dict[str, float]:
    """Trial parameters that skip the candidates which hurt least when skipped alone.

    Single-sublayer sensitivity is a strong first guess that random search rarely matches;
    TPE then searches around it for the interactions it misses.
    """
    kls = [
        _skipped_divergence(target, target_log_probs, [c], input_ids, attention_mask).kl
        for c in tqdm(candidates, desc="DIMR sensitivity", leave=False)
    ]
    ranked = sorted(range(len(candidates)), key=lambda i: kls[i])
    return {_param_name(candidates[i]): 1 - rank / len(candidates) for rank, i in enumerate(ranked)}


def _fingerprint(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> str:
    digest = hashlib.sha256(input_ids.cpu().numpy().tobytes())
    digest.update(attention_mask.cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _open_study(config: DimrConfig, problem: dict[str, object]) -> optuna.Study:
    """Create the study or reopen it, refusing one that was run for another problem."""
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(
        study_name=STUDY_NAME,
        storage=f"sqlite:///{output_dir / 'dimr.db'}",
        load_if_exists=True,
        direction="minimize",
    )
    stored = study.user_attrs.get("problem")
    if stored is None:
        study.set_user_attr("problem", problem)
    elif stored != problem:
        raise CoSpecError(
            f"{output_dir} holds a DIMR study for another model, skip ratio or calibration "
            "batch; use a fresh output_dir"
        )
    return study


@torch.no_grad()
def _time_ratio(
    slim: PreTrainedModel,
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
) -> float:
    """Median slim forward time over median target forward time on the batch.

    The two are timed alternately, after one warm-up each, so that load from other work
    on the machine hits both alike.
    """
    position_ids = position_ids_for(attention_mask)
    times: dict[str, list[float]] = {"slim": [], "target": []}
    for _ in range(TIMING_REPEATS + 1):
        for name, model in (("slim", slim), ("target", target)):
            if input_ids.is_cuda:
                torch.cuda.synchronize(input_ids.device)
            start = time.perf_counter()
            model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            )
            if input_ids.is_cuda:
                torch.cuda.synchronize(input_ids.device)
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["slim"][1:]) / statistics.median(times["target"][1:])


def run_dimr(
    config: DimrConfig,
    target: PreTrainedModel,
    calibration_ids: torch.Tensor,
    calibration_mask: torch.Tensor,
) -> DimrResult:
    """Search the routing mask, then write ``mask.json`` and ``report.json`` to the output dir.

    Resumable: trials completed by an earlier run with the same output dir count towards
    ``n_trials``. Identical masks proposed twice are evaluated once.
    """
    num_layers = len(decoder_layers(target))
    candidates = candidate_sublayers(target)
    num_skip = num_to_skip(target, config.skip_ratio)
    problem = {
        "model": config.model,
        "num_layers": num_layers,
        "num_skip": num_skip,
        "candidates": [f"{layer}.{kind}" for layer, kind in candidates],
        "calibration": _fingerprint(calibration_ids, calibration_mask),
    }
    study = _open_study(config, problem)
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    completed = len(done)
    # TPE samples at random until n_startup_trials trials are complete, counting earlier
    # runs. The seed moves with the trials done so a resumed run does not replay proposals.
    study.sampler = optuna.samplers.TPESampler(
        n_startup_trials=config.n_startup_trials, seed=config.seed + completed
    )
    evaluated: dict[tuple[str, ...], tuple[float, float]] = {
        tuple(trial.user_attrs["skipped"]): (trial.value, trial.user_attrs["greedy_agreement"])
        for trial in done
    }
    target_log_probs = _log_probs(target, calibration_ids, calibration_mask)
    if config.sensitivity_warm_start and not study.trials:
        study.enqueue_trial(
            _sensitivity_scores(
                target, target_log_probs, candidates, calibration_ids, calibration_mask
            )
        )

    def objective(trial: optuna.Trial) -> float:
        scores = [trial.suggest_float(_param_name(c), 0.0, 1.0) for c in candidates]
        ranked = sorted(range(len(candidates)), key=lambda i: scores[i], reverse=True)
        skipped = sorted(candidates[i] for i in ranked[:num_skip])
        key = tuple(f"{layer}.{kind}" for layer, kind in skipped)
        if key not in evaluated:
            result = _skipped_divergence(
                target, target_log_probs, skipped, calibration_ids, calibration_mask
            )
            evaluated[key] = (result.kl, result.greedy_agreement)
        kl, agreement = evaluated[key]
        trial.set_user_attr("skipped", list(key))
        trial.set_user_attr("greedy_agreement", agreement)
        return kl

    remaining = max(0, config.n_trials - completed)
    if remaining:
        verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            study.optimize(
                objective, n_trials=remaining, timeout=config.timeout_s, show_progress_bar=True
            )
        finally:
            optuna.logging.set_verbosity(verbosity)

    finished = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    best = study.best_trial
    skipped = [
        (int(layer), kind)
        for layer, kind in (name.split(".") for name in best.user_attrs["skipped"])
    ]
    mask = mask_from_skipped(num_layers, skipped, config.model)
    slim = build_slim_verifier(target, mask)
    time_ratio = _time_ratio(slim, target, calibration_ids, calibration_mask)
    result = DimrResult(
        mask=mask,
        kl=best.value,
        greedy_agreement=best.user_attrs["greedy_agreement"],
        time_ratio=time_ratio,
        trials_run=len(finished) - completed,
        trials_total=len(finished),
        best_trial=best.number,
    )
    output_dir = Path(config.output_dir)
    mask.save(output_dir / "mask.json")
    report = {key: value for key, value in asdict(result).items() if key != "mask"}
    report |= {
        "model": config.model,
        "skip_ratio": mask.skip_ratio,
        "skipped": mask.skipped_names(),
    }
    (output_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return result
