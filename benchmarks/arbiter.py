"""What the arbiter costs: per-round forward cost and end-to-end tokens/s vs vanilla SPD.

Measured in one run on the toy world (target + math drafter, toy math test prompts):

- ``arbiter_cost_ratio``: one arbiter forward per round (K draft + K target tokens over a
  cached context, adapter on) relative to the target's verify forward (K+1 tokens over
  its cached context), timed on the bare models at a typical context length;
- ``tokens_per_s``: CoSpec with an untrained head (threshold 0.5) vs vanilla SPD, greedy,
  batch 1, same prompts; also their mean accepted lengths and target forwards per token.

    python benchmarks/arbiter.py --json runs/bench/arbiter.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from _shared import run_script
from rich.console import Console
from rich.table import Table
from transformers import DynamicCache

from cospec.arbiter import ArbiterModel
from cospec.engine import Engine, EngineConfig
from cospec.models import load_model, load_tokenizer
from cospec.toy import tasks


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def forward_costs(target, arbiter: ArbiterModel, context: int, k: int, repeats: int) -> dict:
    """Seconds per target verify forward and per arbiter round forward, both cached."""
    ids = torch.randint(4, 60, (1, context))
    target_cache = DynamicCache(config=target.config)
    target(input_ids=ids, cache=target_cache, use_cache=True)
    arbiter_cache = DynamicCache(config=arbiter.peft_model.get_base_model().config)
    mask = torch.ones(1, context, dtype=torch.long)
    block = torch.randint(4, 60, (1, k))
    empty = ids[:, :0]
    arbiter.score_round(ids, mask, torch.arange(context)[None], arbiter_cache, block, block)
    positions = torch.arange(context, context + k + 1)[None]

    def verify() -> None:
        target(input_ids=torch.cat([ids[:, -1:], block], 1), position_ids=positions,
               cache=target_cache, use_cache=True, logits_to_keep=k + 1)
        target_cache.crop(-(k + 1))

    def arbitrate() -> None:
        arbiter.score_round(empty, mask, empty, arbiter_cache, block, block)

    verify_s, arbiter_s = median_time(verify, repeats), median_time(arbitrate, repeats)
    return {"context": context, "target_verify_s": verify_s, "arbiter_round_s": arbiter_s,
            "arbiter_cost_ratio": arbiter_s / verify_s}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--target", default="toy:target")
    parser.add_argument("--drafter", default="toy:drafter_math")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    tokenizer = load_tokenizer(args.target)
    target = load_model(args.target)
    vanilla_drafter = load_model(args.drafter)
    arbiter = ArbiterModel.from_drafter(load_model(args.drafter),
                                        num_draft_tokens=args.num_draft_tokens)
    prompts = [p.prompt for p in tasks.generate("math", "test", args.num_prompts, seed=0)]
    context = len(tokenizer(prompts[0]).input_ids) + args.max_new_tokens // 2
    costs = forward_costs(target, arbiter, context, args.num_draft_tokens, repeats=50)

    base = dict(num_draft_tokens=args.num_draft_tokens, max_new_tokens=args.max_new_tokens,
                batch_size=1)
    runs = {
        "vanilla_spd": Engine(target, tokenizer, [vanilla_drafter], EngineConfig(**base)),
        "cospec_untrained": Engine(target, tokenizer, [], EngineConfig(
            arbiter_mode="threshold", arbiter_threshold=0.5, **base), arbiter=arbiter),
    }
    results = {}
    for name, engine in runs.items():
        engine.generate(prompts[:2])
        stats = engine.generate(prompts).stats
        results[name] = {"tokens_per_s": stats.tokens_per_second,
                         "mean_accepted_length": stats.mean_accepted_length,
                         "target_forwards_per_token": stats.target_forwards_per_token,
                         "arbiter_accept_rate": stats.arbiter_accept_rate,
                         "seconds": stats.seconds}
    ratio = results["cospec_untrained"]["tokens_per_s"] / results["vanilla_spd"]["tokens_per_s"]
    report = {
        "arbiter_cost_ratio": costs["arbiter_cost_ratio"],
        "forward_costs": costs,
        "tokens_per_s": {name: r["tokens_per_s"] for name, r in results.items()},
        "cospec_vs_vanilla_tokens_per_s": ratio,
        "runs": results,
        "settings": vars(args) | {"torch": torch.__version__},
    }
    table = Table(title="Arbiter cost (toy world, batch 1, greedy)")
    for column in ("run", "tokens/s", "MAL", "target fwd/token", "arbiter accept"):
        table.add_column(column)
    for name, r in results.items():
        accept = r["arbiter_accept_rate"]
        table.add_row(name, f"{r['tokens_per_s']:.1f}", f"{r['mean_accepted_length']:.2f}",
                      f"{r['target_forwards_per_token']:.3f}",
                      "-" if accept is None else f"{accept:.2f}")
    console = Console()
    console.print(table)
    console.print(f"arbiter round forward / target verify forward: "
                  f"{costs['arbiter_cost_ratio']:.2f} (context {context}); CoSpec / vanilla "
                  f"tokens/s: {ratio:.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    run_script(main)
