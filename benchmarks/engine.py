"""Engine benchmark: correctness anchors, speed against HF, the ideal-speedup model, batching.

One run, same models, same toy math prompts, everything greedy:

1. Decode every prompt at batch 1 with our target-only, HF ``generate`` (target only), our
   vanilla SPD and HF assisted generation (the drafter as ``assistant_model``, K fixed),
   and with our SPD at batch 4 and 16. The outputs give the correctness anchors (SPD ==
   target-only, SPD == HF assisted, batched == unbatched); the wall times give tokens/s.
2. Micro-time the bare HF forwards a round is made of (target 1 token, target verify of
   K+1 tokens, drafter 1 token, each on a DynamicCache of typical length; prefills) and
   turn the measured acceptance into the ideal SPD speedup; report the share we reach.

Every repeat runs every method once and every cost probe once, interleaved, so that load
from other jobs hits them alike; the best repeat of each counts.

Run:  python benchmarks/engine.py --json runs/bench/engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from _shared import hardware, run_script
from rich.console import Console
from rich.table import Table
from transformers import DynamicCache, PreTrainedModel

from cospec.engine import Engine, EngineConfig
from cospec.models import check_same_vocabulary, load_model, load_tokenizer
from cospec.toy import tasks

GOALS = {"ratio_vs_hf_assisted": 1.5, "ideal_fraction": 0.9, "batch_scaling": 6.0}
BATCH_SIZES = (1, 4, 16)
METHOD_LABELS = {"target": "target-only (ours)", "hf_target": "target-only (HF generate)",
                 "spd": "vanilla SPD (ours)", "hf_assisted": "HF assisted generation"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--target", default="toy:target", help="target model (path or toy:NAME)")
    parser.add_argument("--drafter", default="toy:drafter_math", help="drafter model")
    parser.add_argument("--num-prompts", type=int, default=32, help="toy math test prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="M: tokens per prompt")
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=4, help="K")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs of every method and cost probe; the best counts")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: tiny models are overhead-bound, and more "
                             "threads collapse when other jobs share the cores)")
    parser.add_argument("--probe-calls", type=int, default=60,
                        help="timed forwards per cost probe per repeat (median)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the toy prompts")
    return parser.parse_args(argv)



# --- decoding runs: a callable decodes prompt ids and returns a Run -----------------------

Run = dict  # outputs (new token ids per prompt), tokens (emitted), seconds (wall),
#            cpu_seconds (process CPU time), stats (EngineStats, ours only)
Decode = Callable[[list[list[int]]], Run]


def ours(target, drafter, tokenizer, method: str, k: int, max_new: int, batch: int) -> Decode:
    """Decode prompt ids with our engine."""
    config = EngineConfig(method=method, num_draft_tokens=k, max_new_tokens=max_new,
                          batch_size=batch)
    engine = Engine(target, tokenizer, [drafter] if method == "spd" else [], config)

    def decode(prompts: list[list[int]]) -> Run:
        start, cpu = time.perf_counter(), time.process_time()
        out = engine.generate(prompts)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        return {"outputs": [s.token_ids for s in out.sequences], "tokens": out.stats.emitted_tokens,
                "seconds": seconds, "cpu_seconds": cpu, "stats": out.stats}

    return decode


def hf(target: PreTrainedModel, drafter: PreTrainedModel | None, tokenizer,
       max_new: int) -> Decode:
    """Decode prompt ids one at a time with HF ``generate`` (assisted if a drafter is given)."""
    kwargs = dict(do_sample=False, max_new_tokens=max_new, use_cache=True,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if drafter is not None:
        kwargs["assistant_model"] = drafter

    @torch.inference_mode()
    def decode(prompts: list[list[int]]) -> Run:
        outputs = []
        start, cpu = time.perf_counter(), time.process_time()
        for ids in prompts:
            input_ids = torch.tensor([ids], device=target.device)
            out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
            outputs.append(out[0, len(ids):].tolist())
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        return {"outputs": outputs, "tokens": sum(map(len, outputs)), "seconds": seconds,
                "cpu_seconds": cpu, "stats": None}

    return decode


def fix_assistant_block(drafter: PreTrainedModel, k: int) -> None:
    """Make HF assisted generation draft exactly K tokens per round, like ours.

    HF's defaults adapt the block: ``num_assistant_tokens_schedule`` "heuristic" grows or
    shrinks ``num_assistant_tokens``, and ``assistant_confidence_threshold`` (default 0.4,
    tuned online with sklearn when installed) stops drafting early. 0 disables the latter
    (``None`` would be replaced by the default). HF still stops drafting at an EOS.
    """
    config = drafter.generation_config
    config.num_assistant_tokens = k
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0


# --- cost probes: bare HF forwards ------------------------------------------------------

@torch.inference_mode()
def forward_cost(model: PreTrainedModel, context: int, new: int, calls: int,
                 batch: int = 1) -> tuple[float, float]:
    """Median wall and CPU seconds of a bare forward of ``new`` tokens on a cache of ``context``.

    The cache is cropped back after every call (outside the timed region), so every call
    sees the same context; ``context=0`` times a prefill on a fresh cache.
    """
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (batch, context + new), generator=generator)
    cache = DynamicCache(config=model.config)
    if context:
        model(input_ids=ids[:, :context], cache=cache, use_cache=True)
    wall, cpu = [], []
    for _ in range(calls):
        if not context:
            cache = DynamicCache(config=model.config)
        start, cpu_start = time.perf_counter(), time.process_time()
        model(input_ids=ids[:, context:], cache=cache, use_cache=True, logits_to_keep=new)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        if context:
            cache.crop(-new)
    return statistics.median(wall), statistics.median(cpu)


def cost_probes(target, drafter, k: int, prompt: int, context: int, batch: int,
                calls: int) -> dict[str, Callable[[], tuple[float, float]]]:
    """The forwards the cost model needs, each returning (wall, CPU) seconds per call."""
    few, b = max(2, calls // 10), f"_batch{batch}"
    return {
        "c_t1": lambda: forward_cost(target, context, 1, calls),
        "c_v": lambda: forward_cost(target, context, k + 1, calls),
        "c_d": lambda: forward_cost(drafter, context, 1, calls),
        "target_prefill": lambda: forward_cost(target, 0, prompt, few),
        "drafter_prefill": lambda: forward_cost(drafter, 0, prompt, few),
        "c_v" + b: lambda: forward_cost(target, context, k + 1, few, batch),
        "c_d" + b: lambda: forward_cost(drafter, context, 1, few, batch),
        "target_prefill" + b: lambda: forward_cost(target, 0, prompt, 2, batch),
        "drafter_prefill" + b: lambda: forward_cost(drafter, 0, prompt, 2, batch),
    }


def ideal_spd_seconds(costs: dict[str, float], k: int, stats, num_prompts: int,
                      batch: int = 1) -> float:
    """Bare-forward time of SPD over all prompts: prefills, then full rounds.

    The first round of a batch is the drafter prefill, K-1 drafter steps and the target
    prefill; every later round costs K c_d + c_v at the batch's width. ``stats`` are the
    engine's statistics of that very run: ``target_calls`` counts the batch rounds (a batch
    runs until its longest row finishes). Rows that finish early leave a batch narrower than
    the probes assume, so at batch > 1 this overestimates a little.
    """
    b = "" if batch == 1 else f"_batch{batch}"
    c_d, c_v = costs["c_d" + b], costs["c_v" + b]
    batches = -(-num_prompts // batch)
    first = costs["drafter_prefill" + b] + (k - 1) * c_d + costs["target_prefill" + b]
    return batches * first + (stats.target_calls - batches) * (k * c_d + c_v)


def ideal_model(costs: dict[str, float], k: int, stats, spd_tps: float, target_tps: float,
                num_prompts: int) -> dict[str, object]:
    """Ideal SPD speedup from measured acceptance and per-call costs; the share we reach.

    Target-only pays c_t1 per token. An SPD round pays K drafter steps and one verify and
    emits ``tokens_per_round`` tokens, so ideally SPD runs at tokens_per_round / (K c_d + c_v)
    tokens/s, and the ideal speedup is that times c_t1. ``with_prefill`` adds the prefills
    (target, and drafter for SPD) that neither method can avoid: with short answers they
    are a large share of the time.
    """
    c_t1, c_v, c_d = costs["c_t1"], costs["c_v"], costs["c_d"]
    p_t, p_d = costs["target_prefill"], costs["drafter_prefill"]
    tokens_per_round = stats.emitted_tokens / max(1, stats.rounds)
    round_seconds = k * c_d + c_v
    ideal_spd_tps = tokens_per_round / round_seconds
    ideal_speedup = ideal_spd_tps * c_t1
    achieved = spd_tps / target_tps
    # Target-only emits its first token from the prefill, then one per c_t1. SPD's first
    # round is the drafter prefill, K-1 drafter steps and the target prefill.
    n, tokens = num_prompts, stats.emitted_tokens
    target_seconds = n * p_t + (tokens - n) * c_t1
    spd_seconds = ideal_spd_seconds(costs, k, stats, n)
    ideal_with_prefill = target_seconds / spd_seconds
    return {
        "fraction": achieved / ideal_speedup,
        "ideal_speedup": ideal_speedup,
        "achieved_speedup": achieved,
        "c_t1_ms": 1e3 * c_t1,
        "c_v_ms": 1e3 * c_v,
        "c_d_ms": 1e3 * c_d,
        "tokens_per_round": tokens_per_round,
        "round_ms": 1e3 * round_seconds,
        "ideal_spd_tokens_per_s": ideal_spd_tps,
        "ideal_target_tokens_per_s": 1.0 / c_t1,
        "spd_share_of_ideal": spd_tps / ideal_spd_tps,
        "target_share_of_ideal": target_tps * c_t1,
        "with_prefill": {
            "target_prefill_ms": 1e3 * p_t,
            "drafter_prefill_ms": 1e3 * p_d,
            "ideal_speedup": ideal_with_prefill,
            "fraction": achieved / ideal_with_prefill,
            "ideal_target_tokens_per_s": tokens / target_seconds,
            "ideal_spd_tokens_per_s": tokens / spd_seconds,
            "spd_share_of_ideal": spd_tps * spd_seconds / tokens,
            "target_share_of_ideal": target_tps * target_seconds / tokens,
            "prefill_share_of_ideal_spd": n * (p_t + p_d) / spd_seconds,
        },
    }


def batch_model(costs: dict[str, float], k: int, spd: Run, spd_batch: Run, num_prompts: int,
                batch: int, clock: str = "") -> dict[str, float]:
    """What bare forwards allow for batch-``batch`` over batch-1 SPD, and the share we reach.

    Two limits: a round of ``batch`` rows costs more than a round of one (CPU matmuls are
    not free to widen), and prefill work does not shrink with batching at all. ``clock``
    is "" for wall-clock results, "cpu_" for CPU-time ones (the costs must match).
    """
    b = f"_batch{batch}"
    round_1 = k * costs["c_d"] + costs["c_v"]
    round_b = k * costs["c_d" + b] + costs["c_v" + b]
    prefill = -(-num_prompts // batch) * (costs["target_prefill" + b]
                                          + costs["drafter_prefill" + b])
    ideal_seconds = ideal_spd_seconds(costs, k, spd_batch["stats"], num_prompts, batch)
    ideal = ideal_spd_seconds(costs, k, spd["stats"], num_prompts) / ideal_seconds
    measured = spd_batch[f"{clock}tokens_per_s"] / spd[f"{clock}tokens_per_s"]
    return {
        f"c_v{b}_ms": 1e3 * costs["c_v" + b],
        f"c_d{b}_ms": 1e3 * costs["c_d" + b],
        f"round{b}_ms": 1e3 * round_b,
        "round_scaling": batch * round_1 / round_b,
        f"prefill{b}_seconds": prefill,
        "max_ratio_if_decoding_were_free": spd[f"best_{clock}seconds"] / prefill,
        f"ideal{b}_seconds": ideal_seconds,
        f"share_of_ideal{b}": ideal_seconds / spd_batch[f"best_{clock}seconds"],
        "ratio": measured,
        "ideal_ratio": ideal,
        "fraction": measured / ideal,
    }


# --- the run ------------------------------------------------------------------------------

def best_of(runs: dict[str, Decode], probes: dict[str, Callable[[], tuple[float, float]]],
            prompts: list[list[int]], repeats: int, console: Console
            ) -> tuple[dict[str, dict], dict[str, list[tuple[float, float]]]]:
    """Every repeat runs every method and probe once, interleaved; keep the best of each."""
    results: dict[str, dict] = {name: {"seconds": [], "cpu_seconds": []} for name in runs}
    probe_seconds: dict[str, list[tuple[float, float]]] = {name: [] for name in probes}
    for r in range(repeats):
        for name, decode in runs.items():
            run = decode(prompts)
            for key in ("seconds", "cpu_seconds"):
                results[name][key].append(run.pop(key))
            results[name].update(run)
        for name, probe in probes.items():
            probe_seconds[name].append(probe())
        console.log(f"repeat {r + 1}/{repeats}: " + ", ".join(
            f"{name} {results[name]['tokens'] / results[name]['seconds'][-1]:,.0f}"
            for name in runs) + " tokens/s")
    for res in results.values():
        res["best_seconds"] = min(res["seconds"])
        res["tokens_per_s"] = res["tokens"] / res["best_seconds"]
        res["median_tokens_per_s"] = res["tokens"] / statistics.median(res["seconds"])
        res["best_cpu_seconds"] = min(res["cpu_seconds"])
        res["cpu_tokens_per_s"] = res["tokens"] / res["best_cpu_seconds"]
    return results, probe_seconds


def mismatches(a: list[list[int]], b: list[list[int]]) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    console = Console()
    if not console.is_terminal:
        console.width = 120
    k, max_new, big = args.num_draft_tokens, args.max_new_tokens, BATCH_SIZES[-1]

    tokenizer = load_tokenizer(args.target)
    check_same_vocabulary(tokenizer, load_tokenizer(args.drafter), args.drafter)
    target, drafter = load_model(args.target), load_model(args.drafter)
    fix_assistant_block(drafter, k)
    problems = tasks.generate("math", "test", args.num_prompts, seed=args.seed)
    prompts = [tokenizer(p.prompt, add_special_tokens=True).input_ids for p in problems]
    setup = {
        "load_average_before": os.getloadavg()[0],
        "hardware": hardware(), "target": args.target, "drafter": args.drafter,
        "num_prompts": len(prompts), "max_new_tokens": max_new, "num_draft_tokens": k,
        "repeats": args.repeats, "probe_calls": args.probe_calls,
        "timing": "best of repeats, each over all prompts, after a warm-up run",
    }
    hw = setup["hardware"]
    console.print(f"[bold]CPU[/] {hw['cpu']} ({hw['cpus_usable']} usable of {hw['cpu_count']})"
                  f", torch threads {hw['torch_threads']}, torch {hw['torch']}, "
                  f"transformers {hw['transformers']}")

    runs = {
        "target": ours(target, drafter, tokenizer, "target", k, max_new, 1),
        "hf_target": hf(target, None, tokenizer, max_new),
        "spd": ours(target, drafter, tokenizer, "spd", k, max_new, 1),
        "hf_assisted": hf(target, drafter, tokenizer, max_new),
        **{f"spd_batch{b}": ours(target, drafter, tokenizer, "spd", k, max_new, b)
           for b in BATCH_SIZES if b > 1},
    }
    warm = {name: decode(prompts) for name, decode in runs.items()}
    prompt = round(statistics.mean(map(len, prompts)))
    context = round(prompt + warm["target"]["tokens"] / len(prompts) / 2)
    probe_batch = min(big, len(prompts))  # the widest batch the big-batch run decodes
    probes = cost_probes(target, drafter, k, prompt, context, probe_batch, args.probe_calls)
    results, probe_seconds = best_of(runs, probes, prompts, args.repeats, console)
    wall_costs = {name: min(w for w, _ in values) for name, values in probe_seconds.items()}
    cpu_costs = {name: min(c for _, c in values) for name, values in probe_seconds.items()}
    setup["load_average_after"] = os.getloadavg()[0]

    out = {name: res["outputs"] for name, res in results.items()}
    batched = [f"spd_batch{b}" for b in BATCH_SIZES if b > 1]
    checks = {
        "spd_vs_target": mismatches(out["spd"], out["target"]),
        "spd_vs_hf_assisted": mismatches(out["spd"], out["hf_assisted"]),
        "target_vs_hf_target": mismatches(out["target"], out["hf_target"]),
        **{f"{name}_vs_target": mismatches(out[name], out["target"]) for name in batched},
    }
    tps = {name: results[name]["tokens_per_s"] for name in METHOD_LABELS}
    scaling = {str(b): results["spd" if b == 1 else f"spd_batch{b}"]["tokens_per_s"]
               for b in BATCH_SIZES}
    stats = results["spd"]["stats"]
    report = {
        "greedy_identical": not checks["spd_vs_target"],
        "hf_identical": not checks["spd_vs_hf_assisted"],
        "tokens_per_s": {
            **tps,
            "median": {name: results[name]["median_tokens_per_s"] for name in METHOD_LABELS},
            "cpu_time": {name: results[name]["cpu_tokens_per_s"] for name in METHOD_LABELS},
            "seconds": {name: res["seconds"] for name, res in results.items()},
            "cpu_seconds": {name: res["cpu_seconds"] for name, res in results.items()},
            "tokens": {name: res["tokens"] for name, res in results.items()},
            "mismatching_prompts": checks,
            "setup": setup,
        },
        "ratio_vs_hf_assisted": tps["spd"] / tps["hf_assisted"],
        "ideal_fraction": {
            **ideal_model(wall_costs, k, stats, tps["spd"], tps["target"], len(prompts)),
            "num_draft_tokens": k,
            "context_length": context,
            "prompt_length": prompt,
            "cpu_time": ideal_model(cpu_costs, k, stats, results["spd"]["cpu_tokens_per_s"],
                                    results["target"]["cpu_tokens_per_s"], len(prompts)),
            "probe_wall_ms": {name: [1e3 * w for w, _ in values]
                              for name, values in probe_seconds.items()},
            "engine_seconds_spd": dict(stats.seconds),
        },
        "batch_scaling": {
            "tokens_per_s": scaling,
            "ratio": scaling[str(big)] / scaling["1"],
            "identical_to_target": all(not checks[f"{name}_vs_target"] for name in batched),
            "ideal": batch_model(wall_costs, k, results["spd"], results[f"spd_batch{big}"],
                                 len(prompts), probe_batch),
            "cpu_time": batch_model(cpu_costs, k, results["spd"], results[f"spd_batch{big}"],
                                    len(prompts), probe_batch, clock="cpu_"),
        },
        "target_calls_per_token": {
            "target_forwards_per_token": stats.target_forwards_per_token,
            "target_calls_per_token": stats.target_calls / max(1, stats.emitted_tokens),
            "mean_accepted_length": stats.mean_accepted_length,
            "acceptance_rate": stats.acceptance_rate,
            "accepted_per_position": stats.accepted_per_position,
            "rounds": stats.rounds,
            "emitted_tokens": stats.emitted_tokens,
        },
    }
    print_report(console, report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {args.json}")
    return report


def print_report(console: Console, report: dict) -> None:
    tps = report["tokens_per_s"]
    speed = Table(title="Greedy decoding at batch 1 (best of repeats)")
    for column in ("method", "tokens/s", "median tokens/s", "vs our target-only",
                   "CPU-time tokens/s"):
        speed.add_column(column, justify="left" if column == "method" else "right")
    for name, label in METHOD_LABELS.items():
        speed.add_row(label, f"{tps[name]:,.0f}", f"{tps['median'][name]:,.0f}",
                      f"{tps[name] / tps['target']:.2f}x", f"{tps['cpu_time'][name]:,.0f}")
    console.print(speed)
    setup = tps["setup"]
    load = max(setup["load_average_before"], setup["load_average_after"])
    if load > (setup["hardware"]["cpus_usable"] or 1):
        console.print(f"[yellow]load average {load:.1f} exceeds the usable CPUs: other jobs "
                      "share the cores and wall-clock numbers are noisy (compare the CPU-time "
                      "column)")

    ideal = report["ideal_fraction"]
    pre = ideal["with_prefill"]
    model = Table(title=f"Ideal-speedup model (K={ideal['num_draft_tokens']}, "
                        f"context {ideal['context_length']} tokens)")
    model.add_column("component")
    model.add_column("value", justify="right")
    for label, value in [
        ("c_t1: target forward, 1 token", f"{ideal['c_t1_ms']:.3f} ms"),
        ("c_v: target verify, K+1 tokens", f"{ideal['c_v_ms']:.3f} ms"),
        ("c_d: drafter forward, 1 token", f"{ideal['c_d_ms']:.3f} ms"),
        ("tokens per round (measured)", f"{ideal['tokens_per_round']:.3f}"),
        ("round cost K*c_d + c_v", f"{ideal['round_ms']:.3f} ms"),
        ("ideal SPD tokens/s", f"{ideal['ideal_spd_tokens_per_s']:,.0f}"),
        ("ideal target-only tokens/s (1/c_t1)", f"{ideal['ideal_target_tokens_per_s']:,.0f}"),
        ("SPD share of its ideal", f"{ideal['spd_share_of_ideal']:.2f}"),
        ("target-only share of its ideal", f"{ideal['target_share_of_ideal']:.2f}"),
        ("ideal speedup", f"{ideal['ideal_speedup']:.2f}x"),
        ("achieved speedup", f"{ideal['achieved_speedup']:.2f}x"),
        ("achieved / ideal", f"{ideal['fraction']:.2f}"),
        (f"target prefill, {ideal['prompt_length']} tokens", f"{pre['target_prefill_ms']:.3f} ms"),
        (f"drafter prefill, {ideal['prompt_length']} tokens",
         f"{pre['drafter_prefill_ms']:.3f} ms"),
        ("ideal speedup with prefills", f"{pre['ideal_speedup']:.2f}x"),
        ("achieved / ideal with prefills", f"{pre['fraction']:.2f}"),
        ("achieved / ideal, from CPU times", f"{ideal['cpu_time']['fraction']:.2f}"),
    ]:
        model.add_row(label, value)
    console.print(model)

    scaling = report["batch_scaling"]
    calls = report["target_calls_per_token"]
    summary = Table(title="Summary")
    for column in ("measure", "value", "goal", "met"):
        summary.add_column(column, justify="left" if column == "measure" else "right")

    def row(label: str, value: str, goal: str = "", met: bool | None = None) -> None:
        summary.add_row(label, value, goal, "" if met is None else ("yes" if met else "[red]no"))

    row("SPD == target-only greedy", str(report["greedy_identical"]), "True",
        report["greedy_identical"])
    row("SPD == HF assisted greedy", str(report["hf_identical"]), "True", report["hf_identical"])
    ratio = report["ratio_vs_hf_assisted"]
    row("SPD / HF assisted tokens/s", f"{ratio:.2f}", f">= {GOALS['ratio_vs_hf_assisted']}",
        ratio >= GOALS["ratio_vs_hf_assisted"])
    fraction = ideal["fraction"]
    row("achieved / ideal speedup", f"{fraction:.2f}", f">= {GOALS['ideal_fraction']}",
        fraction >= GOALS["ideal_fraction"])
    for b, value in scaling["tokens_per_s"].items():
        row(f"SPD tokens/s at batch {b}", f"{value:,.0f}")
    big = BATCH_SIZES[-1]
    row(f"batch {big} / batch 1", f"{scaling['ratio']:.2f}", f">= {GOALS['batch_scaling']}",
        scaling["ratio"] >= GOALS["batch_scaling"])
    bound = scaling["ideal"]
    row(f"  ideal from bare forwards (round scaling {bound['round_scaling']:.1f}x)",
        f"{bound['ideal_ratio']:.2f}")
    row("  at most, from prefills alone", f"{bound['max_ratio_if_decoding_were_free']:.2f}")
    cpu = scaling["cpu_time"]
    row(f"  from CPU times (ideal {cpu['ideal_ratio']:.2f})", f"{cpu['ratio']:.2f}")
    row("batched SPD == target-only", str(scaling["identical_to_target"]), "True",
        scaling["identical_to_target"])
    row("target forwards per token (rows)", f"{calls['target_forwards_per_token']:.3f}")
    row("mean accepted length", f"{calls['mean_accepted_length']:.3f}")
    row("acceptance rate", f"{calls['acceptance_rate']:.3f}")
    console.print(summary)
    for name, rows in tps["mismatching_prompts"].items():
        if rows:
            console.print(f"[red]{name}: prompts {rows} differ")


if __name__ == "__main__":
    run_script(main)
