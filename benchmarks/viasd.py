"""VIA-SD benchmark: DIMR against random masks, two tiers against three, a threshold sweep.

One run on the toy world (``toy:target`` verifies, ``toy:drafter_math`` drafts), greedy,
K=4, one torch thread:

1. ``dimr``: the calibration text is the target's greedy continuation of toy math
   *training* prompts. At each skip ratio, DIMR's mask is compared with the best (and the
   median) of as many uniformly random masks as DIMR ran trials, and with every mask of the
   search space. The toy target has 4 layers, so only the 4 sublayers of layers 1-2 are
   candidates: the space holds a handful of masks and random search finds the best one
   too; the report says how likely that was.
2. ``tiers``: target-only, vanilla SPD (2 tiers: drafter, target) and VIA-SD (3 tiers:
   drafter, slim verifier, target) with the DIMR mask of each skip ratio, on toy math test
   prompts at batch 1, where a target row forward is a real target call: rejection rate
   (1 - acceptance), target forwards per token, tokens/s (best of interleaved repeats) and
   task accuracy against target-only. A bare-forward probe gives the slim verifier's cost
   relative to the target's.
3. ``sweep``: alpha_accept x alpha_regen for each DIMR mask. Batched greedy output equals
   per-row output (tested in tests/test_viasd.py, and checked here against the ``tiers``
   run), so the sweep decodes batched: its tokens/s are batched throughput. A table, and a
   plot next to the JSON.

Run:  python benchmarks/viasd.py --json runs/bench/viasd.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import optuna
import torch
from _shared import hardware, run_script
from rich.console import Console
from rich.table import Table
from transformers import DynamicCache, PreTrainedModel

from cospec.dimr import (
    DimrConfig,
    calibration_batch,
    candidate_sublayers,
    mask_from_skipped,
    num_to_skip,
    random_masks_divergence,
    run_dimr,
    slim_divergence,
)
from cospec.engine import Engine, EngineConfig, GenerationOutput
from cospec.engine.trace import TIER_SLIM_ACCEPT, TIER_SLIM_REGENERATE, TIER_TARGET
from cospec.models import check_same_vocabulary, load_model, load_tokenizer
from cospec.slim import RoutingMask, build_slim_verifier
from cospec.toy import tasks

GOALS = {
    "dimr_kl_over_best_random": 0.5,  # at most
    "target_forward_cut_vs_spd": 0.20,  # at least
    "accuracy_points_vs_target": 2.0,  # at most this far below target-only
}
TIERS = (TIER_SLIM_ACCEPT, TIER_SLIM_REGENERATE, TIER_TARGET)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--target", default="toy:target", help="target model (path or toy:NAME)")
    parser.add_argument("--drafter", default="toy:drafter_math", help="drafter model")
    parser.add_argument("--num-prompts", type=int, default=100, help="toy math test prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt")
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=4, help="K")
    parser.add_argument(
        "--skip-ratios",
        default="0.25,0.125",
        help="DIMR skip ratios, comma-separated (0.25 = 2 of the toy target's 8 sublayers)",
    )
    parser.add_argument("--dimr-trials", type=int, default=20, help="DIMR trials per ratio")
    parser.add_argument("--dimr-startup-trials", type=int, default=8, help="random before TPE")
    parser.add_argument("--calibration-prompts", type=int, default=32)
    parser.add_argument("--calibration-max-new-tokens", type=int, default=64)
    parser.add_argument("--alpha-accept", type=float, default=0.9, help="VIA-SD in `tiers`")
    parser.add_argument("--alpha-regen", type=float, default=0.9, help="VIA-SD in `tiers`")
    parser.add_argument("--sweep-accept", default="0.1,0.5,0.9,1.0", help="alpha_accept grid")
    parser.add_argument("--sweep-regen", default="0.5,0.9,0.99,1.0", help="alpha_regen grid")
    parser.add_argument("--batch-size", type=int, default=1, help="batch of the `tiers` runs")
    parser.add_argument("--sweep-batch-size", type=int, default=8, help="batch of the sweep")
    parser.add_argument("--repeats", type=int, default=3, help="timed `tiers` runs (best)")
    parser.add_argument("--probe-calls", type=int, default=200, help="bare forwards per probe")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and searches")
    return parser.parse_args(argv)


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]



# --- 1. DIMR ------------------------------------------------------------------------------


def dimr_section(
    target: PreTrainedModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    skip_ratio: float,
    args: argparse.Namespace,
) -> tuple[dict, RoutingMask]:
    """DIMR's mask against random masks at the same ratio and against the whole space."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        config = DimrConfig(
            model=args.target,
            skip_ratio=skip_ratio,
            n_trials=args.dimr_trials,
            n_startup_trials=args.dimr_startup_trials,
            seed=args.seed,
            output_dir=out,
        )
        result = run_dimr(config, target, ids, mask)
        saved = args.json.with_name(f"{args.json.stem}_mask_{skip_ratio:g}.json")
        shutil.copy(Path(out) / "mask.json", saved)
    dimr_seconds = time.perf_counter() - start

    start = time.perf_counter()
    random_kls = random_masks_divergence(
        target, ids, mask, skip_ratio, n=args.dimr_trials, seed=args.seed + 1
    )
    random_seconds = time.perf_counter() - start

    candidates = candidate_sublayers(target)
    num_skip = num_to_skip(target, skip_ratio)
    num_layers = result.mask.num_layers
    space = {}
    for skipped in itertools.combinations(candidates, num_skip):
        routing = mask_from_skipped(num_layers, skipped)
        divergence = slim_divergence(target, build_slim_verifier(target, routing), ids, mask)
        space[", ".join(routing.skipped_names())] = divergence.kl
    best_random, median_random = min(random_kls), statistics.median(random_kls)
    optimum = min(space.values())
    # Chance that n uniform draws include a given mask: how often random search ties DIMR.
    hit = 1 - (1 - 1 / len(space)) ** len(random_kls)
    expected_best = expected_best_of_random(list(space.values()), len(random_kls))
    # A search that always finds the optimum meets the goal only when every random draw
    # lands on a mask at least 1 / goal times worse.
    worse = sum(kl >= optimum / GOALS["dimr_kl_over_best_random"] for kl in space.values())
    optimum_meets_goal = (worse / len(space)) ** len(random_kls)
    return {
        "skip_ratio": skip_ratio,
        "skipped_sublayers": num_skip,
        "candidates": [f"{layer}.{kind}" for layer, kind in candidates],
        "mask_file": str(saved),
        "dimr": {
            "skipped": result.mask.skipped_names(),
            "kl": result.kl,
            "greedy_agreement": result.greedy_agreement,
            "slim_over_target_time": result.time_ratio,
            "trials": result.trials_total,
            "seconds": dimr_seconds,
        },
        "random": {
            "masks": len(random_kls),
            "best_kl": best_random,
            "median_kl": median_random,
            "kls": random_kls,
            "seconds": random_seconds,
        },
        "space": {"masks": len(space), "optimum_kl": optimum,
                  "expected_best_of_random_kl": expected_best,
                  "optimum_over_expected_best_random": optimum / expected_best,
                  "chance_optimum_meets_goal": optimum_meets_goal,
                  "kl_by_mask": space},
        "dimr_found_optimum": math.isclose(result.kl, optimum, rel_tol=1e-6),
        "kl_over_best_random": result.kl / best_random,
        "kl_over_median_random": result.kl / median_random,
        "chance_random_draws_hit_a_given_mask": hit,
        "meets_goal": result.kl / best_random <= GOALS["dimr_kl_over_best_random"],
    }, result.mask


def expected_best_of_random(kls: list[float], n: int) -> float:
    """Expected minimum KL of ``n`` independent uniform draws from a space with these KLs.

    With the values sorted, the minimum is at least the i-th smallest when all n draws
    land among the M - i largest: P = ((M - i) / M) ** n (0-based i).
    """
    values, m = sorted(kls), len(kls)
    return sum(v * (((m - i) / m) ** n - ((m - i - 1) / m) ** n) for i, v in enumerate(values))


# --- 2. tiers -----------------------------------------------------------------------------


def summarise(
    out: GenerationOutput,
    seconds: float,
    cpu_seconds: float,
    problems: list[tasks.Problem],
    reference: list[list[int]] | None,
) -> dict:
    """Quality and cost of one decode; ``reference`` is target-only output, token ids."""
    s = out.stats
    correct = [tasks.grade(p, q.text) for p, q in zip(problems, out.sequences, strict=True)]
    tier2_bonus = sum(
        r.tiers.count(TIER_SLIM_REGENERATE)
        for q in out.sequences
        for r in q.rounds
        if r.accepted == len(r.draft_tokens)
    )
    tier2 = s.tokens_per_tier.get(TIER_SLIM_REGENERATE, 0)
    drafted = s.drafted_tokens > 0
    return {
        "accuracy": statistics.mean(correct),
        "correct": sum(correct),
        "identical_to_target_only": (
            statistics.mean(
                q.token_ids == ids for q, ids in zip(out.sequences, reference, strict=True)
            )
            if reference is not None
            else 1.0
        ),
        "rejection_rate": 1 - s.acceptance_rate if drafted else None,
        "mean_accepted_length": s.mean_accepted_length if drafted else None,
        "target_forwards_per_token": s.target_forwards_per_token,
        "target_calls_per_token": s.target_calls / max(1, s.emitted_tokens),
        "slim_calls_per_token": s.slim_calls / max(1, s.emitted_tokens),
        "tokens_per_second": s.emitted_tokens / seconds,
        "tokens_per_cpu_second": s.emitted_tokens / max(1e-9, cpu_seconds),
        "emitted_tokens": s.emitted_tokens,
        "rounds": s.rounds,
        "tier_shares": {
            str(t): s.tokens_per_tier.get(t, 0) / max(1, s.emitted_tokens) for t in TIERS
        },
        "tier2_bonus_share": tier2_bonus / tier2 if tier2 else None,
        "engine_seconds": dict(s.seconds),  # the engine's phases (draft, verify, ...)
    }


def accuracy_points(method: dict, target_only: dict, num_problems: int) -> float:
    """Accuracy difference in points, from the counts (no float noise at the goal's edge)."""
    return 100 * (method["correct"] - target_only["correct"]) / num_problems


def decode(engine: Engine, prompts: list[str]) -> tuple[GenerationOutput, float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    out = engine.generate(prompts)
    return out, time.perf_counter() - start, time.process_time() - cpu


def tiers_section(
    target, drafter, tokenizer, masks: dict[float, RoutingMask], problems, args
) -> tuple[dict, list[list[int]]]:
    prompts = [p.prompt for p in problems]
    common = dict(
        num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
    )
    engines = {
        "target": Engine(target, tokenizer, [], EngineConfig(method="target", **common)),
        "spd": Engine(target, tokenizer, [drafter], EngineConfig(**common)),
    }
    viasd = EngineConfig(alpha_accept=args.alpha_accept, alpha_regen=args.alpha_regen, **common)
    for ratio, routing in masks.items():
        slim = build_slim_verifier(target, routing)
        engines[f"viasd@{ratio:g}"] = Engine(
            target, tokenizer, [drafter], viasd, slim_verifier=slim
        )
    best: dict[str, tuple[GenerationOutput, float, float]] = {}
    for _ in range(args.repeats):  # interleaved, so load from other work hits all alike
        for name, engine in engines.items():
            out, seconds, cpu = decode(engine, prompts)
            if name in best:
                kept, best_seconds, best_cpu = best[name]
                same = [s.token_ids for s in kept.sequences] == [
                    s.token_ids for s in out.sequences
                ]
                assert same, f"{name} is not repeatable"
                out = out if seconds < best_seconds else kept  # phase timings of the best
                seconds, cpu = min(seconds, best_seconds), min(cpu, best_cpu)
            best[name] = (out, seconds, cpu)
    reference = [s.token_ids for s in best["target"][0].sequences]
    methods = {
        name: summarise(out, seconds, cpu, problems, reference)
        for name, (out, seconds, cpu) in best.items()
    }
    assert methods["spd"]["identical_to_target_only"] == 1.0, "greedy SPD must be lossless"
    target_only, spd = methods["target"], methods["spd"]
    verdicts = {}
    for name, m in methods.items():
        if not name.startswith("viasd"):
            continue
        cut = 1 - m["target_forwards_per_token"] / spd["target_forwards_per_token"]
        points = accuracy_points(m, target_only, len(problems))
        verdicts[name] = {
            "target_forward_cut_vs_spd": cut,
            "accuracy_points_vs_target": points,
            "speedup_vs_target_only": m["tokens_per_second"] / target_only["tokens_per_second"],
            "speedup_vs_spd": m["tokens_per_second"] / spd["tokens_per_second"],
            "meets_forward_goal": cut >= GOALS["target_forward_cut_vs_spd"],
            "meets_accuracy_goal": points >= -GOALS["accuracy_points_vs_target"],
        }
    spd_speedup = spd["tokens_per_second"] / target_only["tokens_per_second"]
    return {
        "batch_size": args.batch_size,
        "alpha_accept": args.alpha_accept,
        "alpha_regen": args.alpha_regen,
        "methods": methods,
        "spd_speedup_vs_target_only": spd_speedup,
        "viasd": verdicts,
    }, reference


@torch.inference_mode()
def verify_cost(models: dict[str, PreTrainedModel], k: int, context: int, calls: int) -> dict:
    """Median wall time of a bare K+1-token forward on a cache of ``context`` tokens.

    The models are timed alternately so that load from other work hits them alike.
    """
    generator = torch.Generator().manual_seed(0)
    vocab = next(iter(models.values())).config.vocab_size
    ids = torch.randint(3, vocab, (1, context + k + 1), generator=generator)
    caches = {}
    for name, model in models.items():
        caches[name] = DynamicCache(config=model.config)
        model(input_ids=ids[:, :context], cache=caches[name], use_cache=True)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(calls):
        for name, model in models.items():
            start = time.perf_counter()
            model(
                input_ids=ids[:, context:], cache=caches[name], use_cache=True, logits_to_keep=k + 1
            )
            times[name].append(time.perf_counter() - start)
            caches[name].crop(-(k + 1))
    return {name: statistics.median(t) for name, t in times.items()}


# --- 3. sweep ----------------------------------------------------------------------------


def sweep_section(target, drafter, tokenizer, masks, problems, reference, tiers, args) -> dict:
    prompts = [p.prompt for p in problems]
    target_only, spd = tiers["methods"]["target"], tiers["methods"]["spd"]
    rows = []
    for ratio, routing in masks.items():
        slim = build_slim_verifier(target, routing)
        for alpha_accept, alpha_regen in itertools.product(
            floats(args.sweep_accept), floats(args.sweep_regen)
        ):
            config = EngineConfig(
                num_draft_tokens=args.num_draft_tokens,
                max_new_tokens=args.max_new_tokens,
                batch_size=args.sweep_batch_size,
                alpha_accept=alpha_accept,
                alpha_regen=alpha_regen,
            )
            engine = Engine(target, tokenizer, [drafter], config, slim_verifier=slim)
            out, seconds, cpu = decode(engine, prompts)
            m = summarise(out, seconds, cpu, problems, reference)
            cut = 1 - m["target_forwards_per_token"] / spd["target_forwards_per_token"]
            points = accuracy_points(m, target_only, len(problems))
            rows.append(
                {
                    "skip_ratio": ratio,
                    "alpha_accept": alpha_accept,
                    "alpha_regen": alpha_regen,
                    **m,
                    "target_forward_cut_vs_spd": cut,
                    "accuracy_points_vs_target": points,
                    "meets_both_goals": cut >= GOALS["target_forward_cut_vs_spd"]
                    and points >= -GOALS["accuracy_points_vs_target"],
                }
            )
    # The sweep decodes batched; where it repeats the `tiers` thresholds, it must agree.
    agreement = {}
    for ratio in masks:
        same = [
            r
            for r in rows
            if r["skip_ratio"] == ratio
            and r["alpha_accept"] == args.alpha_accept
            and r["alpha_regen"] == args.alpha_regen
        ]
        if same:
            single = tiers["methods"][f"viasd@{ratio:g}"]
            agreement[f"viasd@{ratio:g}"] = all(
                same[0][key] == single[key]
                for key in ("accuracy", "identical_to_target_only", "target_forwards_per_token")
            )
    plot = args.json.with_name(f"{args.json.stem}_sweep.png")
    plot_sweep(rows, masks, target_only, spd, plot)
    return {
        "batch_size": args.sweep_batch_size,
        "alpha_accept": floats(args.sweep_accept),
        "alpha_regen": floats(args.sweep_regen),
        "rows": rows,
        "batched_matches_tiers_run": agreement,
        "plot": str(plot),
    }


def plot_sweep(rows, masks, target_only, spd, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    accepts = sorted({r["alpha_accept"] for r in rows})
    regens = sorted({r["alpha_regen"] for r in rows})
    fig = plt.figure(figsize=(15, 4.2 * len(masks)))
    grid = fig.add_gridspec(len(masks), 3)
    scatter = fig.add_subplot(grid[:, 2])
    for i, ratio in enumerate(masks):
        cells = {(r["alpha_accept"], r["alpha_regen"]): r for r in rows if r["skip_ratio"] == ratio}
        for j, (key, title, cmap) in enumerate(
            [
                ("accuracy_points_vs_target", "accuracy - target-only (points)", "RdYlGn"),
                ("target_forward_cut_vs_spd", "target forwards cut vs SPD", "Blues"),
            ]
        ):
            ax = fig.add_subplot(grid[i, j])
            values = [[cells[(a, g)][key] for g in regens] for a in accepts]
            image = ax.imshow(values, cmap=cmap, aspect="auto", origin="lower")
            for y, row in enumerate(values):
                for x, value in enumerate(row):
                    text = f"{value:+.0f}" if j == 0 else f"{value:.0%}"
                    ax.text(x, y, text, ha="center", va="center", fontsize=9)
            ax.set_xticks(range(len(regens)), [f"{g:g}" for g in regens])
            ax.set_yticks(range(len(accepts)), [f"{a:g}" for a in accepts])
            ax.set_xlabel("alpha_regen")
            ax.set_ylabel("alpha_accept")
            ax.set_title(
                f"skip ratio {ratio:g} ({', '.join(masks[ratio].skipped_names())}): {title}",
                fontsize=9,
            )
            fig.colorbar(image, ax=ax)
        points = [cells[key] for key in sorted(cells)]
        scatter.scatter(
            [p["target_forwards_per_token"] for p in points],
            [100 * p["accuracy"] for p in points],
            label=f"VIA-SD, skip ratio {ratio:g}",
        )
    scatter.scatter(
        [spd["target_forwards_per_token"]],
        [100 * spd["accuracy"]],
        marker="s",
        c="k",
        label="vanilla SPD",
    )
    scatter.scatter([1.0], [100 * target_only["accuracy"]], marker="^", c="r", label="target-only")
    scatter.axhspan(
        100 * target_only["accuracy"] - GOALS["accuracy_points_vs_target"],
        100 * target_only["accuracy"] + 1,
        color="g",
        alpha=0.1,
        label="accuracy goal",
    )
    scatter.axvline(
        (1 - GOALS["target_forward_cut_vs_spd"]) * spd["target_forwards_per_token"],
        color="b",
        ls="--",
        lw=1,
        label="forward goal (left of line)",
    )
    scatter.set_xscale("log")
    scatter.set_xlabel("target forwards per token (log)")
    scatter.set_ylabel("accuracy (%)")
    scatter.set_title("every sweep point", fontsize=9)
    scatter.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- report -------------------------------------------------------------------------------


def print_report(result: dict, console: Console) -> None:
    for d in result["dimr"]["by_skip_ratio"]:
        console.print(
            f"[bold]DIMR[/] skip ratio {d['skip_ratio']:g} ({d['skipped_sublayers']} of "
            f"{len(d['candidates'])} candidate sublayers, {d['space']['masks']} masks in all): "
            f"{', '.join(d['dimr']['skipped'])} KL {d['dimr']['kl']:.3f} (agreement "
            f"{d['dimr']['greedy_agreement']:.3f}, slim/target time "
            f"{d['dimr']['slim_over_target_time']:.2f}); best of {d['random']['masks']} random "
            f"{d['random']['best_kl']:.3f}, median {d['random']['median_kl']:.3f}, optimum "
            f"{d['space']['optimum_kl']:.3f} -> DIMR/best random {d['kl_over_best_random']:.2f} "
            f"(goal <= {GOALS['dimr_kl_over_best_random']}), DIMR/median random "
            f"{d['kl_over_median_random']:.2f}; the optimum is "
            f"{d['space']['optimum_over_expected_best_random']:.2f}x the expected best of "
            f"{d['random']['masks']} random masks and meets the goal against them with "
            f"probability {d['space']['chance_optimum_meets_goal']:.2g}"
        )
    tiers = result["tiers"]
    table = Table(
        title=f"tiers (batch {tiers['batch_size']}, alpha_accept {tiers['alpha_accept']}, "
        f"alpha_regen {tiers['alpha_regen']})"
    )
    for column in (
        "method",
        "accuracy",
        "same as target",
        "rejection",
        "target fwd/tok",
        "slim fwd/tok",
        "tok/s",
        "tok/CPU-s",
        "tiers 1/2/3",
    ):
        table.add_column(column, justify="right")
    for name, m in tiers["methods"].items():
        shares = "/".join(f"{m['tier_shares'][str(t)]:.2f}" for t in TIERS) if m["rounds"] else ""
        rejection = "" if m["rejection_rate"] is None else f"{m['rejection_rate']:.3f}"
        table.add_row(
            name,
            f"{m['accuracy']:.2f}",
            f"{m['identical_to_target_only']:.2f}",
            rejection,
            f"{m['target_forwards_per_token']:.3f}",
            f"{m['slim_calls_per_token']:.3f}",
            f"{m['tokens_per_second']:.0f}",
            f"{m['tokens_per_cpu_second']:.0f}",
            shares if name.startswith("viasd") else "",
        )
    console.print(table)
    for name, v in tiers["viasd"].items():
        console.print(
            f"{name}: target forwards cut {v['target_forward_cut_vs_spd']:.0%} vs SPD (goal >= "
            f"{GOALS['target_forward_cut_vs_spd']:.0%}), accuracy "
            f"{v['accuracy_points_vs_target']:+.1f} points vs target-only (goal >= "
            f"-{GOALS['accuracy_points_vs_target']:g}), speed x{v['speedup_vs_spd']:.2f} vs SPD"
        )
    probe = result["tiers"]["verify_cost"]
    console.print(
        "bare K+1 verify forward, slim / target time: "
        + ", ".join(f"{k} {v:.2f}" for k, v in probe["slim_over_target"].items())
    )
    sweep = result["sweep"]
    table = Table(title=f"sweep (batch {sweep['batch_size']})")
    for column in (
        "skip",
        "a_accept",
        "a_regen",
        "accuracy",
        "pts vs target",
        "rejection",
        "target fwd/tok",
        "target calls/tok",
        "cut vs SPD",
        "tier 2 bonus",
        "tok/CPU-s",
        "goals",
    ):
        table.add_column(column, justify="right")
    for r in sweep["rows"]:
        bonus = "" if r["tier2_bonus_share"] is None else f"{r['tier2_bonus_share']:.2f}"
        table.add_row(
            f"{r['skip_ratio']:g}",
            f"{r['alpha_accept']:g}",
            f"{r['alpha_regen']:g}",
            f"{r['accuracy']:.2f}",
            f"{r['accuracy_points_vs_target']:+.0f}",
            f"{r['rejection_rate']:.3f}",
            f"{r['target_forwards_per_token']:.3f}",
            f"{r['target_calls_per_token']:.3f}",
            f"{r['target_forward_cut_vs_spd']:.0%}",
            bonus,
            f"{r['tokens_per_cpu_second']:.0f}",
            "yes" if r["meets_both_goals"] else "",
        )
    console.print(table)
    console.print(f"sweep plot: {sweep['plot']}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    console = Console(width=150)
    start = time.perf_counter()
    tokenizer = load_tokenizer(args.target)
    check_same_vocabulary(tokenizer, load_tokenizer(args.drafter), args.drafter)
    target, drafter = load_model(args.target), load_model(args.drafter)
    result: dict = {
        "config": vars(args) | {"json": str(args.json)},
        "goals": GOALS,
        "hardware": hardware(),
    }

    calibration = [
        p.prompt for p in tasks.generate("math", "train", args.calibration_prompts, seed=args.seed)
    ]
    ids, mask = calibration_batch(target, tokenizer, calibration, args.calibration_max_new_tokens)
    sections, masks = [], {}
    for ratio in floats(args.skip_ratios):
        section, masks[ratio] = dimr_section(target, ids, mask, ratio, args)
        sections.append(section)
    result["dimr"] = {
        "calibration": {"prompts": len(calibration), "tokens": int(mask.sum()), "split": "train"},
        "by_skip_ratio": sections,
        "seconds": time.perf_counter() - start,
    }

    t = time.perf_counter()
    problems = tasks.generate("math", "test", args.num_prompts, seed=args.seed)
    tiers, reference = tiers_section(target, drafter, tokenizer, masks, problems, args)
    slims = {f"viasd@{r:g}": build_slim_verifier(target, m) for r, m in masks.items()}
    probe = verify_cost({"target": target, **slims}, args.num_draft_tokens, 64, args.probe_calls)
    tiers["verify_cost"] = {
        "context": 64,
        "seconds": probe,
        "slim_over_target": {k: v / probe["target"] for k, v in probe.items() if k != "target"},
    }
    tiers["seconds"] = time.perf_counter() - t
    result["tiers"] = tiers

    t = time.perf_counter()
    result["sweep"] = sweep_section(
        target, drafter, tokenizer, masks, problems, reference, tiers, args
    )
    result["sweep"]["seconds"] = time.perf_counter() - t
    result["seconds"] = time.perf_counter() - start
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print_report(result, console)
    console.print(f"wrote {args.json} in {result['seconds']:.0f} s")
    return result


if __name__ == "__main__":
    run_script(main)
