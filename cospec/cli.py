"""The ``cospec`` command line.

Every subcommand turns a :class:`CoSpecError` into one ``cospec: error: ...`` line on
stderr and exit status 2, so bad input never ends in a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

from cospec.errors import CoSpecError
from cospec.toy.world import WORLD_DIR


def _toy_build(args: argparse.Namespace) -> None:
    import time

    from trainers.toy_pretrain import build_world

    start = time.perf_counter()
    logs = build_world(Path(args.out), seed=args.seed, max_steps=args.max_steps,
                       workers=args.workers)
    for log in logs:
        print(f"{log['name']}: {log['steps']} steps, final loss {log['final_loss']:.4f}, "
              f"{log['seconds']:.0f} s")
    print(f"built the toy world in {args.out} in {time.perf_counter() - start:.0f} s")


def _toy_report(args: argparse.Namespace) -> None:
    from cospec.toy.report import build_report, print_report, write_report

    world = Path(args.world)
    if not world.is_dir():
        raise CoSpecError(f"toy world directory {args.world!r} does not exist")
    report = build_report(world, num_problems=args.num_problems, seed=args.seed)
    print_report(report)
    if args.json:
        write_report(report, Path(args.json))
        print(f"wrote {args.json}")


def _generate(args: argparse.Namespace) -> None:
    from cospec.engine import Engine, EngineConfig
    from cospec.prompts import read_prompts
    from cospec.render import render_sequence

    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += read_prompts(args.prompts_file)
    if not prompts:
        raise CoSpecError("give prompts with --prompt or --prompts-file")
    drafters = args.drafter or ([] if args.method == "target" else ["toy:drafter_math"])
    config = EngineConfig(
        method=args.method, num_draft_tokens=args.num_draft_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=args.batch_size,
        stop_strings=args.stop or [], dtype=args.dtype, device=args.device,
        attn_implementation=args.attn_implementation,
        arbiter_mode=args.arbiter_mode if args.arbiter else "off",
        arbiter_threshold=args.arbiter_threshold,
        bandit={"policy": args.bandit, "reward": args.bandit_reward} if len(drafters) > 1
        else None,
        alpha_accept=args.alpha_accept, alpha_regen=args.alpha_regen,
    )
    engine = Engine.from_pretrained(args.target, drafters, config, arbiter=args.arbiter,
                                    slim_verifier_mask=args.slim_verifier_mask)
    output = engine.generate(prompts)
    if args.json:
        print(json.dumps(output.to_dict()))
        return
    for seq in output.sequences:
        render_sequence(seq, engine.tokenizer, color=not args.no_color)
    s = output.stats
    print(f"[{config.method}] {s.emitted_tokens} tokens in {s.seconds['total']:.2f} s "
          f"({s.tokens_per_second:.1f} tok/s), mean accepted length "
          f"{s.mean_accepted_length:.2f}, target forwards/token {s.target_forwards_per_token:.3f}")


def _push(args: argparse.Namespace) -> None:
    from cospec.arbiter import push_to_hub

    summary = None
    if args.summary:
        path = Path(args.summary)
        if not path.is_file():
            raise CoSpecError(f"training summary {args.summary!r} does not exist")
        summary = json.loads(path.read_text())
    url = push_to_hub(args.arbiter_dir, args.repo_id, private=not args.public,
                      training_summary=summary)
    print(f"pushed {args.arbiter_dir} to {url}")


# Stages with their own config parsers (TrlParser / YAML): the CLI hands them the rest of
# the command line unchanged.
STAGES = {
    "eval": ("eval.harness", "evaluate methods side by side (--config configs/eval/toy.yaml)"),
    "data-gen": ("data_gen.main", "stage 0: vanilla-SPD rollouts with judge labels"),
    "sft": ("trainers.sft", "stage 1: supervised warm-up of the arbiter"),
    "grpo": ("trainers.grpo", "stage 2: GRPO on collaborative rollouts"),
    "dimr": ("cospec.dimr_cli", "search a VIA-SD slim-verifier routing mask"),
    "pipeline": ("cospec.pipeline", "the whole toy-world pipeline, stage by stage"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cospec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    toy = sub.add_parser("toy", help="the embedded toy world").add_subparsers(
        dest="toy_command", required=True)
    build = toy.add_parser("build", help="train the toy models from the recipe")
    build.add_argument("--out", default=str(WORLD_DIR), help="output directory")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--max-steps", type=int, default=None,
                       help="override every model's step budget (quick checks)")
    build.add_argument("--workers", type=int, default=2, help="models trained in parallel")
    build.set_defaults(func=_toy_build)
    report = toy.add_parser("report", help="accuracy, union and acceptance on held-out data")
    report.add_argument("--world", default=str(WORLD_DIR), help="toy world directory")
    report.add_argument("--num-problems", type=int, default=500, help="per family")
    report.add_argument("--seed", type=int, default=0)
    report.add_argument("--json", default=None, help="also write the report to this file")
    report.set_defaults(func=_toy_report)

    gen = sub.add_parser("generate", help="decode prompts and show token provenance")
    gen.add_argument("--target", default="toy:target", help="path, Hub id or toy:NAME")
    gen.add_argument("--drafter", action="append", help="drafter (repeat for several)")
    gen.add_argument("--method", default="spd", choices=["target", "drafter", "spd"])
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    gen.add_argument("--prompts-file", help="one prompt per line, or JSONL with 'prompt'")
    gen.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--stop", action="append", help="stop string (repeat for several)")
    gen.add_argument("--batch-size", type=int, default=16)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--device", default="auto", help="auto (cuda if any), cpu, cuda:N")
    gen.add_argument("--attn-implementation", default="sdpa")
    gen.add_argument("--arbiter", help="CoSpec: a saved arbiter directory (on the 1st drafter)")
    gen.add_argument("--arbiter-mode", default="threshold",
                     choices=["threshold", "sample", "always_accept", "always_reject"])
    gen.add_argument("--arbiter-threshold", type=float, default=0.5)
    gen.add_argument("--bandit", default="ucb",
                     help="MetaSD policy when several --drafter are given")
    gen.add_argument("--bandit-reward", default="bd", choices=["bd", "be"])
    gen.add_argument("--slim-verifier-mask", help="VIA-SD: routing mask JSON from cospec dimr")
    gen.add_argument("--alpha-accept", type=float, default=0.9, help="VIA-SD tier-1 threshold")
    gen.add_argument("--alpha-regen", type=float, default=0.9, help="VIA-SD tier-2 threshold")
    gen.add_argument("--json", action="store_true", help="print results and stats as JSON")
    gen.add_argument("--no-color", action="store_true", help="plain text output")
    gen.set_defaults(func=_generate)

    push = sub.add_parser("push", help="publish a saved arbiter to the Hugging Face Hub")
    push.add_argument("arbiter_dir", help="directory written by ArbiterModel.save_pretrained")
    push.add_argument("repo_id", help="Hub repository, e.g. user/cospec-arbiter")
    push.add_argument("--public", action="store_true", help="create a public repository")
    push.add_argument("--summary", help="JSON file with a training summary for the card")
    push.set_defaults(func=_push)

    for name, (_, help_text) in STAGES.items():
        stage = sub.add_parser(name, help=help_text, add_help=False)
        stage.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in STAGES:
            importlib.import_module(STAGES[argv[0]][0]).main(argv[1:])
            return
        args = build_parser().parse_args(argv)
        func: Callable[[argparse.Namespace], None] = args.func
        func(args)
    except CoSpecError as err:
        print(f"cospec: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
