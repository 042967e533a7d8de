"""Engine benchmark: correctness anchors, speed against HF, the ideal-speedup model, batching.

One run, same models, same toy math prompts, everything greedy:

1. Decode every prompt at batch 1 with our target-only, HF ``generate`` (target only), our
   vanilla SPD and HF assisted generation (the drafter as ``assistant_model``, K fixed).
   The outputs give the correctness anchors (SPD == target-only, SPD == HF assisted) and
   the best-of-N wall times give tokens/s.
2. Micro-time the bare HF forwards the round is made of (target 1 token, target verify of
   K+1 tokens, drafter 1 token, each on a DynamicCache of typical length) and turn the
   measured acceptance into the ideal SPD speedup; report the fraction of it we reach.
3. Decode the same prompts with SPD at batch 4 and 16 (batch scaling).

Run:  python benchmarks/engine.py --json runs/bench/engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.table import Table
from transformers import DynamicCache, PreTrainedModel

from cospec.engine import Engine, EngineConfig
from cospec.models import check_same_vocabulary, load_model, load_tokenizer
from cospec.toy import tasks

GOALS = {"ratio_vs_hf_assisted": 1.5, "ideal_fraction": 0.9, "batch_scaling": 6.0}
BATCH_SIZES = (1, 4, 16)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--target", default="toy:target", help="target model (path or toy:NAME)")
    parser.add_argument("--drafter", default="toy:drafter_math", help="drafter model")
    parser.add_argument("--num-prompts", type=int, default=32, help="toy math test prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="M: tokens per prompt")
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=4, help="K")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method (best)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: tiny models are overhead-bound, and more "
                             "threads collapse when other jobs share the cores)")
    parser.add_argument("--micro-iters", type=int, default=200,
                        help="timed calls per forward in the cost model (median)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the toy prompts")
    return parser.parse_args(argv)


def hardware() -> dict[str, object]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


# --- decoding runs: each callable decodes prompt ids and returns a Run --------------------

Run = dict  # outputs (new token ids per prompt), tokens (emitted), seconds, stats (ours only)


def ours(target, drafter, tokenizer, method: str, k: int, max_new: int, batch: int):
    """A callable decoding the given prompt ids with our engine."""
    config = EngineConfig(method=method, num_draft_tokens=k, max_new_tokens=max_new,
                          batch_size=batch)
    engine = Engine(target, tokenizer, [drafter] if method == "spd" else [], config)

    def decode(prompts: list[list[int]]) -> Run:
        start = time.perf_counter()
        out = engine.generate(prompts)
        seconds = time.perf_counter() - start
        return {"outputs": [s.token_ids for s in out.sequences],
                "tokens": out.stats.emitted_tokens, "seconds": seconds, "stats": out.stats}

    return decode


def hf(target: PreTrainedModel, drafter: PreTrainedModel | None, tokenizer, max_new: int):
    """A callable decoding prompt ids one at a time with HF ``generate`` (assisted if drafter)."""
    kwargs = dict(do_sample=False, max_new_tokens=max_new, use_cache=True,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if drafter is not None:
        kwargs["assistant_model"] = drafter

    @torch.inference_mode()
    def decode(prompts: list[list[int]]) -> Run:
        outputs = []
        start = time.perf_counter()
        for ids in prompts:
            input_ids = torch.tensor([ids], device=target.device)
            out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
            outputs.append(out[0, len(ids):].tolist())
        seconds = time.perf_counter() - start
        return {"outputs": outputs, "tokens": sum(map(len, outputs)), "seconds": seconds,
                "stats": None}

    return decode


def fix_assistant_block(drafter: PreTrainedModel, k: int) -> None:
    """Make HF assisted generation draft exactly K tokens per round, like ours.

    HF's defaults adapt the block: ``num_assistant_tokens_schedule`` "heuristic" grows or
    shrinks ``num_assistant_tokens``, and ``assistant_confidence_threshold`` (default 0.4,
    tuned online with sklearn when installed) stops drafting early. 0 disables the latter
    (``None`` would be replaced by the default).
    """
    config = drafter.generation_config
    config.num_assistant_tokens = k
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0


# --- the cost model -----------------------------------------------------------------------

@torch.inference_mode()
def forward_cost(model: PreTrainedModel, context: int, new: int, iters: int) -> float:
    """Median seconds of one bare forward of ``new`` tokens on a DynamicCache of ``context``.

    The cache is cropped back after every call (outside the timed region), so every call
    sees the same context length.
    """
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.randint(3, vocab, (1, context), generator=generator), cache=cache,
          use_cache=True)
    ids = torch.randint(3, vocab, (1, new), generator=generator)
    times = []
    for _ in range(iters // 10 + iters):
        start = time.perf_counter()
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=new)
        times.append(time.perf_counter() - start)
        cache.crop(-new)
    return statistics.median(times[iters // 10:])


def ideal_model(target, drafter, k: int, context: int, iters: int, spd_stats, spd_tps: float,
                target_tps: float) -> dict[str, float]:
    """Ideal SPD speedup from measured acceptance and per-call costs; the share we reach.

    Target-only pays c_t1 per token. An SPD round pays K drafter steps and one verify and
    emits ``tokens_per_round`` tokens, so ideally SPD runs at tokens_per_round / (K c_d + c_v)
    tokens/s, and the ideal speedup is that times c_t1.
    """
    c_t1 = forward_cost(target, context, 1, iters)
    c_v = forward_cost(target, context, k + 1, iters)
    c_d = forward_cost(drafter, context, 1, iters)
    tokens_per_round = spd_stats.emitted_tokens / max(1, spd_stats.rounds)
    round_seconds = k * c_d + c_v
    ideal_spd_tps = tokens_per_round / round_seconds
    ideal_speedup = ideal_spd_tps * c_t1
    achieved = spd_tps / target_tps
    return {
        "fraction": achieved / ideal_speedup,
        "ideal_speedup": ideal_speedup,
        "achieved_speedup": achieved,
        "c_t1_ms": 1e3 * c_t1,
        "c_v_ms": 1e3 * c_v,
        "c_d_ms": 1e3 * c_d,
        "context_length": context,
        "num_draft_tokens": k,
        "tokens_per_round": tokens_per_round,
        "round_ms": 1e3 * round_seconds,
        "ideal_spd_tokens_per_s": ideal_spd_tps,
        "ideal_target_tokens_per_s": 1.0 / c_t1,
        "spd_share_of_ideal": spd_tps / ideal_spd_tps,
        "target_share_of_ideal": target_tps * c_t1,
        "engine_seconds_spd": dict(spd_stats.seconds),
    }


# --- the run ------------------------------------------------------------------------------

def best_of(runs: dict[str, Callable[[list[list[int]]], Run]], prompts: list[list[int]],
            repeats: int, console: Console) -> dict[str, dict]:
    """Warm every method up, then time them interleaved ``repeats`` times; keep the best."""
    for decode in runs.values():
        decode(prompts[:4])
    results: dict[str, dict] = {name: {"seconds": []} for name in runs}
    for r in range(repeats):
        for name, decode in runs.items():
            run = decode(prompts)
            seconds = run.pop("seconds")
            results[name].update(run)
            results[name]["seconds"].append(seconds)
            console.log(f"repeat {r + 1}/{repeats} {name}: "
                        f"{run['tokens'] / seconds:,.0f} tokens/s")
    for res in results.values():
        res["best_seconds"] = min(res["seconds"])
        res["tokens_per_s"] = res["tokens"] / res["best_seconds"]
        res["median_tokens_per_s"] = res["tokens"] / statistics.median(res["seconds"])
    return results


def mismatches(a: list[list[int]], b: list[list[int]]) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    console = Console()
    k, max_new = args.num_draft_tokens, args.max_new_tokens

    tokenizer = load_tokenizer(args.target)
    check_same_vocabulary(tokenizer, load_tokenizer(args.drafter), args.drafter)
    target, drafter = load_model(args.target), load_model(args.drafter)
    fix_assistant_block(drafter, k)
    problems = tasks.generate("math", "test", args.num_prompts, seed=args.seed)
    prompts = [tokenizer(p.prompt, add_special_tokens=True).input_ids for p in problems]
    setup = {
        "hardware": hardware(), "target": args.target, "drafter": args.drafter,
        "num_prompts": len(prompts), "max_new_tokens": max_new, "num_draft_tokens": k,
        "repeats": args.repeats, "timing": "best of repeats, all prompts per run, after warm-up",
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
    }
    batched = {f"spd_batch{b}": ours(target, drafter, tokenizer, "spd", k, max_new, b)
               for b in BATCH_SIZES if b > 1}
    results = best_of({**runs, **batched}, prompts, args.repeats, console)
    spd_stats = results["spd"]["stats"]
    tps = {name: results[name]["tokens_per_s"] for name in runs}

    out = {name: results[name]["outputs"] for name in results}
    checks = {
        "spd_vs_target": mismatches(out["spd"], out["target"]),
        "spd_vs_hf_assisted": mismatches(out["spd"], out["hf_assisted"]),
        "target_vs_hf_target": mismatches(out["target"], out["hf_target"]),
        **{f"{name}_vs_target": mismatches(out[name], out["target"]) for name in batched},
    }

    mean_len = statistics.mean(map(len, prompts)) + spd_stats.emitted_tokens / len(prompts) / 2
    ideal = ideal_model(target, drafter, k, round(mean_len), args.micro_iters, spd_stats,
                        tps["spd"], tps["target"])
    scaling = {str(b): results["spd" if b == 1 else f"spd_batch{b}"]["tokens_per_s"]
               for b in BATCH_SIZES}
    report = {
        "greedy_identical": not checks["spd_vs_target"],
        "hf_identical": not checks["spd_vs_hf_assisted"],
        "tokens_per_s": {
            **tps,
            "median": {name: results[name]["median_tokens_per_s"] for name in runs},
            "seconds": {name: results[name]["seconds"] for name in results},
            "tokens": {name: results[name]["tokens"] for name in results},
            "mismatching_prompts": checks,
            "setup": setup,
        },
        "ratio_vs_hf_assisted": tps["spd"] / tps["hf_assisted"],
        "ideal_fraction": ideal,
        "batch_scaling": {
            "tokens_per_s": scaling,
            "ratio": scaling[str(BATCH_SIZES[-1])] / scaling["1"],
            "identical_to_target": all(not checks[f"{n}_vs_target"] for n in batched),
        },
        "target_calls_per_token": {
            "target_forwards_per_token": spd_stats.target_forwards_per_token,
            "target_calls_per_token": spd_stats.target_calls / max(1, spd_stats.emitted_tokens),
            "mean_accepted_length": spd_stats.mean_accepted_length,
            "acceptance_rate": spd_stats.acceptance_rate,
            "accepted_per_position": spd_stats.accepted_per_position,
            "rounds": spd_stats.rounds,
            "emitted_tokens": spd_stats.emitted_tokens,
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
    for column in ("method", "tokens/s", "median tokens/s", "vs our target-only"):
        speed.add_column(column, justify="left" if column == "method" else "right")
    labels = {"target": "target-only (ours)", "hf_target": "target-only (HF generate)",
              "spd": "vanilla SPD (ours)", "hf_assisted": "HF assisted generation"}
    for name, label in labels.items():
        speed.add_row(label, f"{tps[name]:,.0f}", f"{tps['median'][name]:,.0f}",
                      f"{tps[name] / tps['target']:.2f}x")
    console.print(speed)

    ideal = report["ideal_fraction"]
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
    row(f"batch {BATCH_SIZES[-1]} / batch 1", f"{scaling['ratio']:.2f}",
        f">= {GOALS['batch_scaling']}", scaling["ratio"] >= GOALS["batch_scaling"])
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
    main()
