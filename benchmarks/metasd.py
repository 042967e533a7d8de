"""MetaSD benchmark: the drafter bandit against fixed drafters and the per-task oracle.

One run on the toy world (``toy:target``; drafter 0 = ``toy:drafter_math``, drafter 1 =
``toy:drafter_string``), greedy, K=4, batch size 1 (the bandit state is per query), one
torch thread. Every configuration decodes the same prompts with the same two-drafter
engine; only the bandit config changes:

- ``drafter_math`` / ``drafter_string``: the ``fixed`` policy on one drafter;
- ``oracle``: the specialist of each prompt's family (math prompts decoded with the math
  drafter fixed, string prompts with the string drafter; statistics summed);
- ``ucb_bd``, ``ucb_be``: UCB with the BD / BE reward; ``discounted_ucb`` (BD),
  ``exp3`` (BD), ``random``.

Greedy SPD is exact, so every configuration must emit the same tokens (checked, reported
as ``outputs_identical``); they differ only in mean accepted length (MAL, vLLM's
``1 + accepted / rounds`` over all rounds of the workload) and tokens/s. Tokens/s is wall
clock on a shared machine: compare it within one run only. Each configuration runs
``--repeats`` times, interleaved with the others, and keeps its fastest time; tokens per CPU
second (one thread, so process CPU time) is less disturbed by other jobs on the cores.

Workloads
---------
``mixed``: math and string test problems interleaved (m, s, m, s, ...). Best-arm curves
(UCB-BD and UCB-BE on mixed): for each round t, among the queries still decoding at round
t, the fraction whose drafter at round t is the specialist of the query's family;
``best_arm_rounds`` is the first t where it reaches 0.8. UCB tries every drafter once, in
index order, so rounds 1 and 2 are the math and the string drafter for every query (0.5 by
construction on a balanced workload); the curves can only separate from round 3 on.

``drifting``: the toy world cannot produce a change of best drafter *within* one
generation. Its models are trained on single ``Q: ...\\nA:`` rows and stop at ``<eos>``
after one answer: a question combining a math and a string task gets one (math-format)
answer, a prompt with a solved Q/A pair before the open question leaves every model out of
distribution, and text after ``<eos>`` is untrained noise (all checked by hand while
writing this benchmark). So ``drifting`` is the closest honest proxy: every prompt is two
training-format rows as token ids, ``<bos> Q_a A_a <eos> <bos> Q_b \\nA:``, a solved problem
of one family followed by an open problem of the other (families alternate between
prompts). The context drifts from one family to the other; the generation answers only
``Q_b``, and the "oracle" is the specialist of ``Q_b``'s family. The models were not
trained on such contexts: expect low MAL for everyone and report the target's accuracy
(``target_accuracy``) to show how far out of distribution it is. Results on it say how the
policies cope with a pool where neither drafter is good, not how they track drift within a
generation (the bandit unit tests cover that on synthetic rewards).

Goals (reported, not enforced): UCB-BD's MAL on mixed is above every single drafter's and
within 10% of the oracle's; BD reaches the 0.8 best-arm fraction in fewer rounds than BE.
``--beta`` sets UCB's exploration weight for every UCB variant (default: BanditConfig's);
``--beta-sweep`` adds UCB-BD / UCB-BE runs on mixed at other betas (key ``beta_sweep``).

Toy-world queries last only 5-9 rounds, so exploration is expensive: at beta=1 UCB
re-explores the wrong specialist around round 5-6 of many queries; beta <= 0.5 does not.

Run:  python benchmarks/metasd.py --json runs/bench/metasd.json --beta 0.5 --beta-sweep 1.0 0.3
Writes the JSON and the best-arm plot next to it (same stem, ``.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from _shared import hardware
from rich.console import Console
from rich.table import Table

from cospec.bandit import BanditConfig
from cospec.engine import Engine, EngineConfig
from cospec.engine.trace import SequenceResult
from cospec.models import load_model, load_tokenizer
from cospec.toy import tasks

DRAFTERS = ("toy:drafter_math", "toy:drafter_string")
BEST_ARM = {"math": 0, "string": 1}
BEST_ARM_THRESHOLD = 0.8
ORACLE_GAP = 0.10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--target", default="toy:target", help="target model (path or toy:NAME)")
    parser.add_argument("--mixed-per-family", type=int, default=40,
                        help="test problems per family in the mixed workload")
    parser.add_argument("--drifting-per-family", type=int, default=16,
                        help="prompts per open-question family in the drifting workload")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="mixed workload budget")
    parser.add_argument("--drifting-max-new-tokens", type=int, default=40,
                        help="drifting workload budget (its answers rarely reach <eos>)")
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=4, help="K")
    parser.add_argument("--beta", type=float, default=BanditConfig.beta,
                        help="UCB exploration weight of every UCB variant")
    parser.add_argument("--beta-sweep", type=float, nargs="*", default=[],
                        help="extra betas for UCB-BD / UCB-BE on mixed")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs per configuration (interleaved; fastest kept)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: tiny models are overhead-bound)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the problems and bandits")
    return parser.parse_args(argv)



# --- workloads ---------------------------------------------------------------------------


@dataclass
class Workload:
    """Prompts (text or token ids), the problem each one asks, and the decoding budget."""

    prompts: list[str | list[int]]
    problems: list[tasks.Problem]
    max_new_tokens: int

    @property
    def families(self) -> list[str]:
        return [p.family for p in self.problems]


def mixed_workload(per_family: int, seed: int, max_new: int) -> Workload:
    math = tasks.generate("math", "test", per_family, seed)
    string = tasks.generate("string", "test", per_family, seed)
    problems = [p for pair in zip(math, string, strict=True) for p in pair]
    return Workload([p.prompt for p in problems], problems, max_new)


def drifting_workload(tokenizer, per_family: int, seed: int, max_new: int) -> Workload:
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
    return Workload(prompts, problems, max_new)


# --- runs --------------------------------------------------------------------------------


def bandit_configs(beta: float, seed: int) -> dict[str, dict[str, object]]:
    """The bandit config of every pooled configuration (oracle is built from the fixed ones)."""
    return {
        "drafter_math": {"policy": "fixed", "fixed_arm": 0},
        "drafter_string": {"policy": "fixed", "fixed_arm": 1},
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
                          batch_size=1, bandit=bandit)
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


def summary(run: dict[str, object], workload: Workload) -> dict[str, object]:
    sequences: list[SequenceResult] = run["sequences"]
    rounds = [r for seq in sequences for r in seq.rounds]
    best = [BEST_ARM[f] for f in workload.families]
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


def run_workload(models, workload: Workload, k: int, beta: float, seed: int, repeats: int,
                 console: Console) -> tuple[dict[str, object], dict[str, dict]]:
    """Every configuration on one workload: summaries, plus the raw runs for the curves.

    The repeats are interleaved (every configuration once, then again) so that a change of
    load on the shared cores hits all of them; each keeps its fastest wall and CPU time.
    """
    families = workload.families

    def oracle() -> dict[str, object]:
        return merge([
            decode(models, workload, {"policy": "fixed", "fixed_arm": arm}, k,
                   [i for i, f in enumerate(families) if f == family])
            for family, arm in BEST_ARM.items()
        ])

    configs = {name: (lambda bandit=bandit: decode(models, workload, bandit, k))
               for name, bandit in bandit_configs(beta, seed).items()}
    configs["oracle"] = oracle
    runs: dict[str, dict] = {}
    for repeat in range(repeats):
        for name, run_config in configs.items():
            run = run_config()
            if name in runs:
                same = [s.token_ids for s in run["sequences"]] == [
                    s.token_ids for s in runs[name]["sequences"]]
                assert same, f"{name}: greedy outputs changed between repeats"
                for key in ("seconds", "cpu_seconds"):
                    run[key] = min(run[key], runs[name][key])
            runs[name] = run
            console.log(f"{name} (repeat {repeat + 1}): {run['seconds']:.1f} s")
    outputs = {name: [s.token_ids for s in run["sequences"]] for name, run in runs.items()}
    reference = outputs["drafter_math"]
    result = {
        "num_prompts": len(workload.prompts),
        "families": {f: families.count(f) for f in BEST_ARM},
        "max_new_tokens": workload.max_new_tokens,
        "repeats": repeats,
        "outputs_identical": all(o == reference for o in outputs.values()),
        "configs": {name: summary(run, workload) for name, run in runs.items()},
    }
    return result, runs


def best_arm_curve(run: dict[str, object], families: list[str]) -> dict[str, list]:
    """Per round t (1-based): fraction of queries still decoding whose drafter is the best."""
    sequences: list[SequenceResult] = run["sequences"]
    longest = max(len(s.rounds) for s in sequences)
    fraction, alive = [], []
    for t in range(longest):
        rows = [(s.rounds[t].drafter, BEST_ARM[f])
                for s, f in zip(sequences, families, strict=True) if len(s.rounds) > t]
        alive.append(len(rows))
        fraction.append(sum(d == b for d, b in rows) / len(rows))
    return {"round": list(range(1, longest + 1)), "fraction": fraction, "alive": alive}


def first_round_reaching(curve: dict[str, list], threshold: float) -> int | None:
    return next((t for t, f in zip(curve["round"], curve["fraction"], strict=True)
                 if f >= threshold), None)


def plot_curves(curves: dict[str, dict[str, list]], path: Path, beta: float) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state (Agg canvas)

    fig = Figure(figsize=(6, 3.6))
    ax = fig.add_subplot()
    for name, curve in curves.items():
        ax.plot(curve["round"], curve["fraction"], marker="o", label=name)
    ax.axhline(BEST_ARM_THRESHOLD, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("round t")
    ax.set_ylabel("queries on the best drafter")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"MetaSD best-arm fraction, mixed workload (UCB, beta={beta})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def goals(mixed: dict[str, object], rounds: dict[str, int | None]) -> dict[str, object]:
    mal = {name: c["mean_accepted_length"] for name, c in mixed["configs"].items()}
    singles = max(mal["drafter_math"], mal["drafter_string"])
    gap = 1.0 - mal["ucb_bd"] / mal["oracle"]
    bd, be = rounds["bd"], rounds["be"]
    return {
        "ucb_bd_beats_every_single_drafter": mal["ucb_bd"] > singles,
        "ucb_bd_gap_to_oracle": gap,
        "ucb_bd_within_10pct_of_oracle": gap <= ORACLE_GAP,
        "bd_reaches_best_arm_before_be": bd is not None and (be is None or bd < be),
    }


def print_table(console: Console, title: str, result: dict[str, object]) -> None:
    table = Table(title=f"{title}: {result['num_prompts']} prompts, "
                        f"outputs identical: {result['outputs_identical']}")
    for column in ("config", "MAL", "tokens/s", "tokens/cpu-s", "rounds/query", "on best",
                   "switches", "acc"):
        table.add_column(column, justify="right")
    for name, c in result["configs"].items():
        table.add_row(name, f"{c['mean_accepted_length']:.3f}", f"{c['tokens_per_second']:.0f}",
                      f"{c['tokens_per_cpu_second']:.0f}",
                      f"{c['rounds_per_query']:.2f}",
                      f"{c['share_of_rounds_on_best_drafter']:.2f}",
                      str(c["drafter_switches"]), f"{c['accuracy']:.2f}")
    console.print(table)


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console(stderr=True, width=110)
    start = time.perf_counter()
    tokenizer = load_tokenizer(args.target)
    models = (load_model(args.target), tokenizer, [load_model(d) for d in DRAFTERS])
    k = args.num_draft_tokens
    machine = hardware()

    mixed_load = mixed_workload(args.mixed_per_family, args.seed, args.max_new_tokens)
    warm_up = Workload(mixed_load.prompts[:4], mixed_load.problems[:4], mixed_load.max_new_tokens)
    decode(models, warm_up, {"policy": "round_robin"}, k)  # first calls are slow: untimed
    mixed, mixed_runs = run_workload(models, mixed_load, k, args.beta, args.seed,
                                     args.repeats, console)
    print_table(console, "mixed", mixed)
    drifting_load = drifting_workload(tokenizer, args.drifting_per_family, args.seed,
                                      args.drifting_max_new_tokens)
    drifting, _ = run_workload(models, drifting_load, k, args.beta, args.seed,
                               args.repeats, console)
    drifting["target_accuracy"] = drifting["configs"]["drafter_math"]["accuracy"]
    drifting["design"] = ("<bos> Q_a A_a <eos> <bos> Q_b \\nA: (solved problem of one family, "
                          "open problem of the other); oracle = specialist of Q_b's family")
    print_table(console, "drifting", drifting)

    curves = {f"ucb_{r}": best_arm_curve(mixed_runs[f"ucb_{r}"], mixed_load.families)
              for r in ("bd", "be")}
    rounds = {r: first_round_reaching(curves[f"ucb_{r}"], BEST_ARM_THRESHOLD)
              for r in ("bd", "be")}

    mal = {name: c["mean_accepted_length"] for name, c in mixed["configs"].items()}
    sweep = {}
    for beta in args.beta_sweep:
        for reward in ("bd", "be"):
            run = decode(models, mixed_load, {"policy": "ucb", "reward": reward, "beta": beta}, k)
            curve = best_arm_curve(run, mixed_load.families)
            sweep[f"ucb_{reward}_beta{beta}"] = {
                "beta": beta, "reward": reward, **summary(run, mixed_load),
                "best_arm_round": first_round_reaching(curve, BEST_ARM_THRESHOLD),
                "best_arm_fraction": curve["fraction"],
            }
            entry = sweep[f"ucb_{reward}_beta{beta}"]
            entry["gap_to_oracle"] = 1.0 - entry["mean_accepted_length"] / mal["oracle"]
            entry["beats_every_single_drafter"] = entry["mean_accepted_length"] > max(
                mal["drafter_math"], mal["drafter_string"])
            console.log(f"sweep ucb_{reward} beta={beta}: "
                        f"MAL {sweep[f'ucb_{reward}_beta{beta}']['mean_accepted_length']:.3f}")

    result = {
        "command": " ".join(["benchmarks/metasd.py", *(sys.argv[1:] if argv is None else argv)]),
        "hardware": machine,
        "settings": {"target": args.target, "drafters": list(DRAFTERS), "k": k, "greedy": True,
                     "batch_size": 1, "beta": args.beta, "seed": args.seed,
                     "best_arm_threshold": BEST_ARM_THRESHOLD},
        "mixed": mixed,
        "drifting": drifting,
        "best_arm_curves": curves,
        "best_arm_rounds": rounds,
        "beta_sweep": sweep,
        "goals": goals(mixed, rounds),
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
    main()
