"""MetaSD benchmark: the drafter bandit against fixed drafters and the per-task oracle.

One run on the toy world: ``toy:target`` with, by default, drafter 0 =
``toy:drafter_math_small`` and drafter 1 = ``toy:drafter_string_small`` (``--drafters`` sets
another pool), lossless sampling at T=1 (``--temperature 0`` decodes greedily), K=4, batch
size 1 (the bandit state is per query), one torch thread. Every configuration decodes the
same prompts with the same multi-drafter engine; only the bandit config changes:

- one ``fixed`` configuration per drafter, named after it (``drafter_math_small``, ...);
- ``oracle``: the best drafter of each prompt's family, measured (the fixed drafter with
  the highest MAL on that family's prompts; each family decoded with it, statistics summed);
- ``ucb_bd``, ``ucb_be``: UCB with the BD / BE reward; ``discounted_ucb`` (BD),
  ``exp3`` (BD), ``random``.

SPD is lossless: under greedy every configuration must emit the same tokens (checked,
reported as ``outputs_identical``) and they differ only in mean accepted length (MAL,
vLLM's ``1 + accepted / rounds`` over all rounds of the workload) and tokens/s; under
sampling each configuration draws its own samples from the same distribution (the seed is
shared), so accuracy also varies by sampling noise. Tokens/s is wall clock on a shared
machine: compare it within one run only. Each configuration runs ``--repeats`` times,
interleaved with the others, and keeps its fastest time; tokens per CPU second (one
thread, so process CPU time) is less disturbed by other jobs on the cores.

Why this pool and temperature
-----------------------------
SPEC's case for BD over BE is that BE is noisy: 0 about half the time even for the best
drafter, in the published setting of 68M drafters for a 7B target. Each workload reports
``be_zero_share_by_family``, the share of every fixed drafter's rounds with nothing
accepted. The full specialists (``toy:drafter_math``, ``toy:drafter_string``) accept so
much that it is about 0.03 for the best drafter: one pull of each drafter settles the
choice and both rewards reach 0.8 at the earliest possible round. The small specialists
(1 layer, hidden 32, ~1/50 of the target's parameters) are in the published BE = 0 regime
(the published figures themselves are greedy). Under
sampling, 1 - TV(p, q) is exactly the probability that a draft token is accepted, so BD is
the expected per-position acceptance, measured on all K positions, where BE sees one
draw; under greedy it is a proxy (acceptance depends on argmax agreement only). The
default is therefore T=1; ``--temperature 0`` runs the paper's greedy setting.
``--drafters toy:drafter_math toy:drafter_string toy:drafter_mixed`` gives a pool with a
generalist that is a close second on both families.

Workloads
---------
``mixed``: math and string test problems interleaved (m, s, m, s, ...). Best-arm curves
(UCB-BD and UCB-BE on mixed), over the queries still decoding at round t: ``fraction``,
the share whose drafter at round t is the best drafter of the query's family, and
``cumulative``, the mean share of rounds 1..t on it. ``best_arm_rounds`` gives, for each
(``per_round``, ``cumulative``), the first t where it reaches 0.8. UCB tries every drafter
once, in index order, so with N drafters the curves can only separate from round N+1 on.

``drifting``: the toy world cannot produce a change of best drafter *within* one
generation. Its models are trained on single ``Q: ...\\nA:`` rows and stop at ``<eos>``
after one answer: a question combining a math and a string task gets one (math-format)
answer, a prompt with a solved Q/A pair before the open question leaves every model out of
distribution, and text after ``<eos>`` is untrained noise (all checked by hand while
writing this benchmark). So ``drifting`` is the closest honest proxy: every prompt is two
training-format rows as token ids, ``<bos> Q_a A_a <eos> <bos> Q_b \\nA:``, a solved problem
of one family followed by an open problem of the other (families alternate between
prompts). The context drifts from one family to the other; the generation answers only
``Q_b``, and the "oracle" is the best drafter (measured on this workload) of ``Q_b``'s
family. The models were not trained on such contexts: expect low MAL for everyone and
report the target's accuracy (``target_accuracy``) to show how far out of distribution it
is. Results on it say how the policies cope with a pool where no drafter is good, not how
they track drift within a generation (the bandit unit tests cover that on synthetic
rewards).

The oracle's counts are those of each prompt's best fixed run (its time comes from decoding
each family with its best drafter): under greedy the two are identical (checked), under
sampling a second decode would be another sample, not the oracle of these runs.

Goals (reported, not enforced): UCB-BD's MAL on mixed is above every single drafter's and
within 10% of the oracle's; BD reaches the 0.8 best-arm ratio in fewer rounds than BE (per
round and cumulative). A ratio counts as reached only over at least ``MIN_ALIVE`` queries
still decoding. With N drafters UCB pulls each once first, so even perfect play reaches 0.8
per round at round N+1 and cumulatively at round 5(N-1): 5 with two drafters, 10 with
three.
``--beta`` sets UCB's exploration weight for every UCB variant; ``--beta-sweep`` adds
UCB-BD / UCB-BE runs on mixed at other betas (key ``beta_sweep``). beta is not published
(SPEC 2.3). The default 0.3 is our choice for toy queries, which last only 11-18 rounds,
so every re-exploration of the wrong drafter is expensive; the default sweep reports 1.0
(textbook UCB1, BanditConfig's default) and 0.5 next to it (a sweep beta equal to
``--beta`` is skipped: it is the main run).

Run:  python benchmarks/metasd.py --json runs/bench/metasd.json
      python benchmarks/metasd.py --json runs/bench/metasd_greedy.json --temperature 0
      python benchmarks/metasd.py --json runs/bench/metasd_full.json \
          --drafters toy:drafter_math toy:drafter_string [toy:drafter_mixed]
Writes the JSON and the best-arm plot next to it (same stem, ``.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch
from _shared import hardware, run_script
from rich.console import Console
from rich.table import Table

from cospec.bandit import BanditConfig
from cospec.engine import Engine, EngineConfig
from cospec.engine.trace import SequenceResult
from cospec.models import check_same_vocabulary, load_model, load_tokenizer
from cospec.toy import tasks

DRAFTERS = ("toy:drafter_math_small", "toy:drafter_string_small")
FAMILIES = ("math", "string")
BEST_ARM_THRESHOLD = 0.8
MIN_ALIVE = 10  # later rounds hold a handful of long queries: noise, not a trend
RESERVED_LABELS = ("ucb_bd", "ucb_be", "discounted_ucb", "exp3", "random", "oracle")
ORACLE_GAP = 0.10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--target", default="toy:target", help="target model (path or toy:NAME)")
    parser.add_argument("--drafters", nargs="+", default=list(DRAFTERS),
                        help="the drafter pool (paths or toy:NAME), in arm order")
    parser.add_argument("--mixed-per-family", type=int, default=100,
                        help="test problems per family in the mixed workload")
    parser.add_argument("--drifting-per-family", type=int, default=16,
                        help="prompts per open-question family in the drifting workload")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="mixed workload budget")
    parser.add_argument("--drifting-max-new-tokens", type=int, default=40,
                        help="drifting workload budget (its answers rarely reach <eos>)")
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=4, help="K")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="0: greedy; > 0: lossless sampling at this temperature")
    parser.add_argument("--beta", type=float, default=0.3,
                        help="UCB exploration weight of every UCB variant")
    parser.add_argument("--beta-sweep", type=float, nargs="*",
                        default=[BanditConfig.beta, 0.5],
                        help="extra betas for UCB-BD / UCB-BE on mixed")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs per configuration (interleaved; fastest kept)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: tiny models are overhead-bound)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the problems, the bandits and the sampling")
    args = parser.parse_args(argv)
    labels = [drafter_label(d) for d in args.drafters]
    clashes = sorted({x for x in labels if labels.count(x) > 1 or x in RESERVED_LABELS})
    if clashes:
        parser.error(f"drafter names must be distinct and not a configuration's name: "
                     f"{clashes} (configurations are named after the drafters' last path part)")
    for flag in ("repeats", "mixed_per_family", "drifting_per_family", "max_new_tokens",
                 "drifting_max_new_tokens", "num_draft_tokens", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args



# --- workloads ---------------------------------------------------------------------------


@dataclass
class Workload:
    """Prompts (text or token ids), the problem each one asks, and how to decode them."""

    prompts: list[str | list[int]]
    problems: list[tasks.Problem]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0

    @property
    def families(self) -> list[str]:
        return [p.family for p in self.problems]


def mixed_workload(per_family: int, seed: int, max_new: int, temperature: float) -> Workload:
    math = tasks.generate("math", "test", per_family, seed)
    string = tasks.generate("string", "test", per_family, seed)
    problems = [p for pair in zip(math, string, strict=True) for p in pair]
    return Workload([p.prompt for p in problems], problems, max_new, temperature, seed)


def drifting_workload(tokenizer, per_family: int, seed: int, max_new: int,
                      temperature: float) -> Workload:
    """``<bos> Q_a A_a <eos> <bos> Q_b \\nA:`` with a and b of different families."""
    math = tasks.generate("math", "test", 2 * per_family, seed + 1)
    string = tasks.generate("string", "test", 2 * per_family, seed + 1)

    def row(problem: tasks.Problem, solved: bool) -> list[int]:
        ids = tokenizer(problem.prompt).input_ids
        if solved:
            ids += tokenizer(problem.solution, add_special_tokens=False).input_ids
            ids.append(tokenizer.eos_token_id)
        return ids

    prompts, problems = [], []
    for i in range(2 * per_family):
        solved, open_ = (math[i], string[i]) if i % 2 else (string[i], math[i])
        prompts.append(row(solved, True) + row(open_, False))
        problems.append(open_)
    return Workload(prompts, problems, max_new, temperature, seed)


# --- runs --------------------------------------------------------------------------------


def drafter_label(name: str) -> str:
    """``toy:drafter_math`` and ``/runs/x/drafter_math`` both read ``drafter_math``."""
    return name.removeprefix("toy:").rstrip("/").rsplit("/", 1)[-1]


def bandit_configs(drafters: list[str], beta: float, seed: int) -> dict[str, dict[str, object]]:
    """The bandit config of every pooled configuration (oracle is built from the fixed ones)."""
    return {
        **{drafter_label(d): {"policy": "fixed", "fixed_arm": arm}
           for arm, d in enumerate(drafters)},
        "ucb_bd": {"policy": "ucb", "reward": "bd", "beta": beta},
        "ucb_be": {"policy": "ucb", "reward": "be", "beta": beta},
        "discounted_ucb": {"policy": "discounted_ucb", "reward": "bd", "beta": beta},
        "exp3": {"policy": "exp3", "reward": "bd", "seed": seed},
        "random": {"policy": "random", "seed": seed},
    }


def decode(models, workload: Workload, bandit: dict, k: int,
           indices: list[int] | None = None) -> dict[str, object]:
    """Decode (a subset of) the workload; return the counts the summaries are made of."""
    target, tokenizer, drafters = models
    config = EngineConfig(num_draft_tokens=k, max_new_tokens=workload.max_new_tokens,
                          temperature=workload.temperature, seed=workload.seed, batch_size=1,
                          bandit=bandit)
    indices = list(range(len(workload.prompts))) if indices is None else indices
    engine = Engine(target, tokenizer, drafters, config)
    cpu = time.process_time()
    out = engine.generate([workload.prompts[i] for i in indices])
    cpu = time.process_time() - cpu
    stats = out.stats
    return {
        "indices": indices,
        "sequences": out.sequences,
        "rounds": stats.rounds,
        "accepted": stats.accepted_tokens,
        "emitted": stats.emitted_tokens,
        "seconds": stats.seconds["total"],
        "cpu_seconds": cpu,
        "switches": stats.drafter_switches,
    }


def merge(parts: list[dict[str, object]]) -> dict[str, object]:
    """One run out of runs on disjoint subsets (the oracle), back in workload order."""
    order = sorted((i, seq) for part in parts
                   for i, seq in zip(part["indices"], part["sequences"], strict=True))
    merged = {key: sum(part[key] for part in parts)
              for key in ("rounds", "accepted", "emitted", "seconds", "cpu_seconds", "switches")}
    merged["indices"] = [i for i, _ in order]
    merged["sequences"] = [seq for _, seq in order]
    return merged


def family_accepted(run: dict[str, object], workload: Workload, family: str) -> list[int]:
    """Accepted draft tokens of every round the run spent on ``family``'s prompts."""
    return [r.accepted for s, f in zip(run["sequences"], workload.families, strict=True)
            if f == family for r in s.rounds]


def family_mal(fixed_runs: list[dict[str, object]], workload: Workload) -> list[dict[str, float]]:
    """Per fixed drafter (arm order), its MAL on each family's prompts."""
    def mal(accepted: list[int]) -> float:
        return 1.0 + sum(accepted) / max(1, len(accepted))

    return [{f: mal(family_accepted(run, workload, f)) for f in FAMILIES} for run in fixed_runs]


def family_be_zero(fixed_runs: list[dict[str, object]], workload: Workload
                   ) -> list[dict[str, float]]:
    """Per fixed drafter, the share of its rounds on each family with BE = 0 (nothing
    accepted): the regime check. SPEC's case for BD is that this is about half even for the
    best drafter; with the full specialists it is at most 0.06, and one pull of each drafter
    settles the choice for either reward."""
    def zero_share(accepted: list[int]) -> float:
        return sum(a == 0 for a in accepted) / max(1, len(accepted))

    return [{f: zero_share(family_accepted(run, workload, f)) for f in FAMILIES}
            for run in fixed_runs]


def best_arms(mal: list[dict[str, float]]) -> dict[str, int]:
    """Each family's best drafter: the fixed drafter with the highest MAL on its prompts."""
    return {f: max(range(len(mal)), key=lambda arm: mal[arm][f]) for f in FAMILIES}


def counts(sequences: list[SequenceResult]) -> dict[str, object]:
    """The counts ``summary`` reads, recomputed from sequences."""
    return {"sequences": sequences, "rounds": sum(len(s.rounds) for s in sequences),
            "accepted": sum(s.accepted for s in sequences),
            "emitted": sum(len(s.token_ids) for s in sequences), "switches": 0}


def summary(run: dict[str, object], workload: Workload, best_arm: dict[str, int]
            ) -> dict[str, object]:
    sequences: list[SequenceResult] = run["sequences"]
    rounds = [r for seq in sequences for r in seq.rounds]
    best = [best_arm[f] for f in workload.families]
    on_best = sum(r.drafter == b for seq, b in zip(sequences, best, strict=True)
                  for r in seq.rounds)
    correct = [tasks.grade(p, s.text) for p, s in zip(workload.problems, sequences, strict=True)]
    return {
        "mean_accepted_length": 1.0 + run["accepted"] / max(1, run["rounds"]),
        "tokens_per_second": run["emitted"] / max(1e-9, run["seconds"]),
        "tokens_per_cpu_second": run["emitted"] / max(1e-9, run["cpu_seconds"]),
        "rounds_per_query": run["rounds"] / len(sequences),
        "tokens_per_query": run["emitted"] / len(sequences),
        "seconds": run["seconds"],
        "cpu_seconds": run["cpu_seconds"],
        "share_of_rounds_on_best_drafter": on_best / max(1, len(rounds)),
        "drafter_switches": run["switches"],
        "accuracy": sum(correct) / len(correct),
    }


def run_workload(models, drafters: list[str], workload: Workload, k: int, beta: float,
                 seed: int, repeats: int, console: Console
                 ) -> tuple[dict[str, object], dict[str, dict], dict[str, int]]:
    """Every configuration on one workload: summaries, the raw runs, each family's best arm.

    The repeats are interleaved (every configuration once, then again) so that a change of
    load on the shared cores hits all of them; each keeps its fastest wall and CPU time.
    The fixed drafters run first, so the oracle knows each family's best drafter.
    """
    families = workload.families
    fixed = [drafter_label(d) for d in drafters]
    runs: dict[str, dict] = {}

    def oracle() -> dict[str, object]:
        fixed_runs = [runs[name] for name in fixed]
        best = best_arms(family_mal(fixed_runs, workload))
        timed = merge([
            decode(models, workload, {"policy": "fixed", "fixed_arm": arm}, k,
                   [i for i, f in enumerate(families) if f == family])
            for family, arm in best.items()
        ])
        picked = [fixed_runs[best[f]]["sequences"][i] for i, f in enumerate(families)]
        if workload.temperature == 0:
            assert [s.token_ids for s in timed["sequences"]] == [s.token_ids for s in picked]
        return timed | counts(picked)

    configs = {name: (lambda bandit=bandit: decode(models, workload, bandit, k))
               for name, bandit in bandit_configs(drafters, beta, seed).items()}
    configs["oracle"] = oracle
    for repeat in range(repeats):
        for name, run_config in configs.items():
            run = run_config()
            if name in runs:
                same = [s.token_ids for s in run["sequences"]] == [
                    s.token_ids for s in runs[name]["sequences"]]
                assert same, f"{name}: outputs changed between repeats (same seed)"
                for key in ("seconds", "cpu_seconds"):
                    run[key] = min(run[key], runs[name][key])
            runs[name] = run
            console.log(f"{name} (repeat {repeat + 1}): {run['seconds']:.1f} s")
    outputs = {name: [s.token_ids for s in run["sequences"]] for name, run in runs.items()}
    reference = outputs[fixed[0]]
    fixed_runs = [runs[name] for name in fixed]
    mal = family_mal(fixed_runs, workload)
    best = best_arms(mal)
    result = {
        "num_prompts": len(workload.prompts),
        "families": {f: families.count(f) for f in FAMILIES},
        "best_drafter": {f: fixed[arm] for f, arm in best.items()},
        "mal_by_family": dict(zip(fixed, mal, strict=True)),
        "be_zero_share_by_family": dict(zip(fixed, family_be_zero(fixed_runs, workload),
                                            strict=True)),
        "max_new_tokens": workload.max_new_tokens,
        "repeats": repeats,
        "outputs_identical": (all(o == reference for o in outputs.values())
                              if workload.temperature == 0 else None),
        "configs": {name: summary(run, workload, best) for name, run in runs.items()},
    }
    return result, runs, best


def best_arm_curve(run: dict[str, object], families: list[str], best_arm: dict[str, int]
                   ) -> dict[str, list]:
    """Best-arm ratios per round t (1-based), over the queries still decoding at round t.

    ``fraction``: share whose drafter at round t is the best one. ``cumulative``: mean share
    of each query's rounds 1..t spent on the best drafter (the bandit literature's optimal-
    arm ratio): it also charges the rounds a reward needed to get there.
    """
    sequences: list[SequenceResult] = run["sequences"]
    longest = max(len(s.rounds) for s in sequences)
    fraction, cumulative, alive = [], [], []
    for t in range(longest):
        rows = [[r.drafter == best_arm[f] for r in s.rounds[:t + 1]]
                for s, f in zip(sequences, families, strict=True) if len(s.rounds) > t]
        alive.append(len(rows))
        fraction.append(sum(row[-1] for row in rows) / len(rows))
        # Exact: 66 queries at exactly 4/5 must compare equal to the 0.8 threshold.
        cumulative.append(float(sum(Fraction(sum(row), len(row)) for row in rows) / len(rows)))
    return {"round": list(range(1, longest + 1)), "fraction": fraction,
            "cumulative": cumulative, "alive": alive}


def first_round_reaching(curve: dict[str, list], threshold: float, key: str = "fraction"
                         ) -> int | None:
    """First round whose ratio reaches ``threshold`` over at least ``MIN_ALIVE`` queries."""
    return next((t for t, f, alive in zip(curve["round"], curve[key], curve["alive"],
                                          strict=True)
                 if f >= threshold and alive >= MIN_ALIVE), None)


def plot_curves(curves: dict[str, dict[str, list]], path: Path, beta: float) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state (Agg canvas)

    fig = Figure(figsize=(10, 3.6))
    panels = {"fraction": "queries on the best drafter at round t",
              "cumulative": "share of rounds 1..t on the best drafter"}
    for i, (key, label) in enumerate(panels.items()):
        ax = fig.add_subplot(1, 2, i + 1)
        for name, curve in curves.items():
            shown = [t for t, alive in enumerate(curve["alive"]) if alive >= MIN_ALIVE]
            ax.plot([curve["round"][t] for t in shown], [curve[key][t] for t in shown],
                    marker="o", label=name)
        ax.axhline(BEST_ARM_THRESHOLD, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("round t")
        ax.set_ylabel(label)
        ax.set_ylim(0, 1.05)
        ax.legend()
    fig.suptitle(f"MetaSD best-arm ratios, mixed workload (UCB, beta={beta}; rounds with "
                 f">= {MIN_ALIVE} queries still decoding)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def goals(mixed: dict[str, object], rounds: dict[str, dict[str, int | None]],
          fixed: list[str]) -> dict[str, object]:
    mal = {name: c["mean_accepted_length"] for name, c in mixed["configs"].items()}
    singles = max(mal[name] for name in fixed)
    gap = 1.0 - mal["ucb_bd"] / mal["oracle"]

    def earlier(bd: int | None, be: int | None) -> bool:
        return bd is not None and (be is None or bd < be)

    return {
        "ucb_bd_beats_every_single_drafter": mal["ucb_bd"] > singles,
        "ucb_bd_gap_to_oracle": gap,
        "ucb_bd_within_10pct_of_oracle": gap <= ORACLE_GAP,
        "bd_reaches_best_arm_before_be": {ratio: earlier(r["bd"], r["be"])
                                          for ratio, r in rounds.items()},
    }


def print_table(console: Console, title: str, result: dict[str, object]) -> None:
    identical = result["outputs_identical"]
    identical = "n/a (sampling)" if identical is None else identical
    table = Table(title=f"{title}: {result['num_prompts']} prompts, "
                        f"outputs identical: {identical}")
    for column in ("config", "MAL", "tokens/s", "tokens/cpu-s", "rounds/query", "on best",
                   "switches", "acc"):
        table.add_column(column, justify="right")
    for name, c in result["configs"].items():
        table.add_row(name, f"{c['mean_accepted_length']:.3f}", f"{c['tokens_per_second']:.0f}",
                      f"{c['tokens_per_cpu_second']:.0f}",
                      f"{c['rounds_per_query']:.2f}",
                      f"{c['share_of_rounds_on_best_drafter']:.2f}",
                      str(c["drafter_switches"]), f"{c['accuracy']:.2f}")
    table.caption = "rounds with BE = 0: " + "; ".join(
        f"{name} " + ", ".join(f"{family} {share:.2f}" for family, share in shares.items())
        for name, shares in result["be_zero_share_by_family"].items())
    console.print(table)


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console(stderr=True, width=110)
    start = time.perf_counter()
    tokenizer = load_tokenizer(args.target)
    for drafter in args.drafters:
        check_same_vocabulary(tokenizer, load_tokenizer(drafter), drafter)
    models = (load_model(args.target), tokenizer, [load_model(d) for d in args.drafters])
    fixed = [drafter_label(d) for d in args.drafters]
    k = args.num_draft_tokens
    machine = hardware()

    mixed_load = mixed_workload(args.mixed_per_family, args.seed, args.max_new_tokens,
                                args.temperature)
    warm_up = Workload(mixed_load.prompts[:4], mixed_load.problems[:4], mixed_load.max_new_tokens,
                       mixed_load.temperature, mixed_load.seed)
    decode(models, warm_up, {"policy": "round_robin"}, k)  # first calls are slow: untimed
    mixed, mixed_runs, best = run_workload(models, args.drafters, mixed_load, k, args.beta,
                                           args.seed, args.repeats, console)
    print_table(console, "mixed", mixed)
    drifting_load = drifting_workload(tokenizer, args.drifting_per_family, args.seed,
                                      args.drifting_max_new_tokens, args.temperature)
    drifting, _, _ = run_workload(models, args.drafters, drifting_load, k, args.beta, args.seed,
                                  args.repeats, console)
    drifting["target_accuracy"] = drifting["configs"][fixed[0]]["accuracy"]
    drifting["design"] = ("<bos> Q_a A_a <eos> <bos> Q_b \\nA: (solved problem of one family, "
                          "open problem of the other); oracle = best drafter of Q_b's family")
    print_table(console, "drifting", drifting)

    curves = {f"ucb_{r}": best_arm_curve(mixed_runs[f"ucb_{r}"], mixed_load.families, best)
              for r in ("bd", "be")}
    rounds = {ratio: {r: first_round_reaching(curves[f"ucb_{r}"], BEST_ARM_THRESHOLD, key)
                      for r in ("bd", "be")}
              for ratio, key in (("per_round", "fraction"), ("cumulative", "cumulative"))}

    mal = {name: c["mean_accepted_length"] for name, c in mixed["configs"].items()}
    sweep = {}
    for beta in [b for b in args.beta_sweep if b != args.beta]:
        for reward in ("bd", "be"):
            run = decode(models, mixed_load, {"policy": "ucb", "reward": reward, "beta": beta}, k)
            curve = best_arm_curve(run, mixed_load.families, best)
            sweep[f"ucb_{reward}_beta{beta}"] = {
                "beta": beta, "reward": reward, **summary(run, mixed_load, best),
                "best_arm_round": first_round_reaching(curve, BEST_ARM_THRESHOLD),
                "best_arm_round_cumulative": first_round_reaching(curve, BEST_ARM_THRESHOLD,
                                                                  "cumulative"),
                "best_arm_fraction": curve["fraction"],
                "best_arm_cumulative": curve["cumulative"],
            }
            entry = sweep[f"ucb_{reward}_beta{beta}"]
            entry["gap_to_oracle"] = 1.0 - entry["mean_accepted_length"] / mal["oracle"]
            entry["beats_every_single_drafter"] = entry["mean_accepted_length"] > max(
                mal[name] for name in fixed)
            console.log(f"sweep ucb_{reward} beta={beta}: "
                        f"MAL {sweep[f'ucb_{reward}_beta{beta}']['mean_accepted_length']:.3f}")

    result = {
        "command": " ".join(["benchmarks/metasd.py", *(sys.argv[1:] if argv is None else argv)]),
        "hardware": machine,
        "settings": {"target": args.target, "drafters": args.drafters, "k": k,
                     "temperature": args.temperature, "batch_size": 1, "beta": args.beta,
                     "seed": args.seed,
                     "best_arm_threshold": BEST_ARM_THRESHOLD},
        "mixed": mixed,
        "drifting": drifting,
        "best_arm_curves": curves,
        "best_arm_rounds": rounds,
        "beta_sweep": sweep,
        "goals": goals(mixed, rounds, fixed),
        "seconds": time.perf_counter() - start,
    }
    result["hardware"]["load_average_at_end"] = os.getloadavg()[0]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    plot_curves(curves, args.json.with_suffix(".png"), args.beta)
    console.print(f"best_arm_rounds: {rounds}")
    console.print(f"goals: {result['goals']}")
    console.print(f"wrote {args.json} and {args.json.with_suffix('.png')} "
                  f"in {result['seconds']:.0f} s")
    return result


if __name__ == "__main__":
    run_script(main)
