"""Search the routing mask of a target's slim verifier (DIMR) from the command line.

This is ``cospec dimr``. The target continues the calibration prompts greedily (toy task
prompts by default, or a prompts file), DIMR searches the mask at the given skip ratio, and
the result is printed and written to the output directory (``mask.json``, ``report.json``,
the resumable study ``dimr.db``). Load the mask at inference with
``Engine.from_pretrained(..., slim_verifier_mask=".../mask.json")``.

The flags are the fields of :class:`cospec.dimr.DimrConfig` (same names, dashes for
underscores, same help), plus where the calibration prompts come from.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path

import torch

from cospec.dimr import DimrConfig, DimrResult, calibration_batch, run_dimr
from cospec.models import DTYPES, load_model, load_tokenizer
from cospec.prompts import read_prompts
from cospec.toy import tasks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``dimr`` flags to ``parser`` (a subcommand parser or a standalone one)."""
    hints = typing.get_type_hints(DimrConfig)
    for f in dataclasses.fields(DimrConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
            continue
        if isinstance(kind, types.UnionType):  # ``X | None``: the flag takes an X
            kind = next(t for t in typing.get_args(kind) if t is not type(None))
        parser.add_argument(flag, type=kind, default=f.default, help=help_text)
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--prompts-family",
        choices=sorted(tasks.FAMILIES),
        default=None,
        help="calibrate on toy training prompts of this family (default: all toy families, "
        "split evenly)",
    )
    source.add_argument(
        "--prompts-file",
        default=None,
        help="calibrate on these prompts: one per line (\\n for a newline) or JSONL with "
        "a 'prompt' field",
    )
    parser.add_argument(
        "--prompts-seed", type=int, default=0, help="seed of the toy prompts drawn for calibration"
    )
    parser.add_argument(
        "--dtype", default="float32", choices=list(DTYPES), help="dtype the target is loaded in"
    )
    parser.add_argument(
        "--device",
        default=None,
        help="where the target runs (default: cuda when available, else cpu)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cospec dimr", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser


def toy_prompts(family: str | None, n: int, seed: int) -> list[str]:
    """``n`` toy *training* prompts (calibration must not see the test split)."""
    families = [family] if family else sorted(tasks.FAMILIES)
    counts = [n // len(families) + (i < n % len(families)) for i in range(len(families))]
    return [
        problem.prompt
        for name, count in zip(families, counts, strict=True)
        if count
        for problem in tasks.generate(name, "train", count, seed=seed)
    ]


def run(args: argparse.Namespace) -> DimrResult:
    """Build the calibration text, run the search, print the result; errors are CoSpecError."""
    config = DimrConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DimrConfig)})
    if args.prompts_file:
        prompts = read_prompts(args.prompts_file)[: config.calibration_prompts]
    else:
        prompts = toy_prompts(args.prompts_family, config.calibration_prompts, args.prompts_seed)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = load_model(config.model, dtype=args.dtype, device=device)
    tokenizer = load_tokenizer(config.model)
    ids, mask = calibration_batch(target, tokenizer, prompts, config.calibration_max_new_tokens)
    print(
        f"calibration: {len(prompts)} prompts, {int(mask.sum())} tokens "
        f"({config.calibration_max_new_tokens} generated per prompt at most)"
    )
    result = run_dimr(config, target, ids, mask)
    skipped = result.mask.skipped_names()
    output_dir = Path(config.output_dir)
    print(
        f"mask: skips {len(skipped)} of {2 * result.mask.num_layers} sublayers "
        f"(ratio {result.mask.skip_ratio:.3f}): {', '.join(skipped)}"
    )
    print(
        f"KL(target || slim) {result.kl:.4f}, greedy agreement {result.greedy_agreement:.3f}, "
        f"slim/full forward time {result.time_ratio:.3f}"
    )
    print(
        f"best trial {result.best_trial} of {result.trials_total} "
        f"({result.trials_run} run now); wrote {output_dir / 'mask.json'} and "
        f"{output_dir / 'report.json'}"
    )
    return result


def main(argv: list[str] | None = None) -> DimrResult:
    """Parse ``argv`` and run; a user-facing problem raises :class:`CoSpecError`."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
