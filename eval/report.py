"""Summaries, the markdown report and the plots of an evaluation run.

Everything here is computed from the rows of ``samples.jsonl`` alone, so a resumed run
and an uninterrupted one summarise the same way. Definitions (SPEC.md section 4):

- accuracy: share of samples graded correct;
- tokens/s: emitted tokens over decoding time; speedup: tokens/s over the target-only
  method's tokens/s measured in the same run;
- mean accepted length: 1 + accepted draft tokens / rounds (vLLM's definition), for
  methods that draft;
- target forwards per token: target row forwards over emitted tokens (1.0 target-only);
- arbiter accept rate: share of the mismatches the arbiter judged that it accepted;
- non-nested recovery: of the problems the drafter-only method solves and the target-only
  method does not, the share a method solves (:func:`non_nested_recovery`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

BASELINES = ("target", "drafter")
ACCURACY_VS_SPEEDUP = "accuracy_vs_speedup.png"
ACCEPTANCE_BY_POSITION = "acceptance_by_position.png"


def non_nested_problems(
    drafter: Mapping[str, bool] | None, target: Mapping[str, bool] | None
) -> list[str]:
    """Sample ids the drafter-only method solves and the target-only method does not."""
    if drafter is None or target is None:
        return []
    return [i for i, ok in drafter.items() if ok and i in target and not target[i]]


def non_nested_recovery(
    correct: Mapping[str, bool],
    drafter: Mapping[str, bool] | None,
    target: Mapping[str, bool] | None,
) -> float | None:
    """Share of :func:`non_nested_problems` that ``correct`` (sample id -> bool) solves.

    None when a baseline is missing or the drafter solves nothing the target misses.
    """
    gap = non_nested_problems(drafter, target)
    if not gap:
        return None
    return sum(bool(correct.get(i, False)) for i in gap) / len(gap)


def find_baseline(methods: Mapping[str, str], kind: str) -> str | None:
    """The method named ``kind``, else the first whose engine method is ``kind``."""
    if methods.get(kind) == kind:
        return kind
    return next((name for name, method in methods.items() if method == kind), None)


def method_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate one method's rows (sums first, ratios last)."""
    n = len(rows)
    total = Counter()
    for r in rows:
        for key in ("correct", "tokens", "seconds", "rounds", "draft_rounds", "drafted",
                    "accepted", "target_forwards", "arbiter_decisions", "arbiter_accepts"):
            total[key] += r[key]
    width = max((len(r["accepted_per_position"]) for r in rows), default=0)
    positions = [sum(r["accepted_per_position"][j] for r in rows
                     if j < len(r["accepted_per_position"])) for j in range(width)]
    groups: dict[str, list[bool]] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r["correct"])
    drafted = total["drafted"]
    return {
        "num_samples": n,
        "correct": total["correct"],
        "accuracy": total["correct"] / n if n else None,
        "tokens": total["tokens"],
        "seconds": total["seconds"],
        "tokens_per_second": _ratio(total["tokens"], total["seconds"]),
        "mean_accepted_length": 1 + total["accepted"] / total["rounds"] if drafted else None,
        "acceptance_rate": total["accepted"] / drafted if drafted else None,
        "target_forwards_per_token": _ratio(total["target_forwards"], total["tokens"]),
        "arbiter_accept_rate": _ratio(total["arbiter_accepts"], total["arbiter_decisions"]),
        "acceptance_by_position": [p / total["draft_rounds"] for p in positions]
        if total["draft_rounds"] else [],
        "accuracy_by_group": {g: sum(v) / len(v) for g, v in sorted(groups.items())}
        if len(groups) > 1 or "" not in groups else {},
        "finish_reasons": dict(Counter(r["finish_reason"] for r in rows)),
    }


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize(
    rows: list[dict[str, Any]], methods: Mapping[str, str], sample_ids: list[str]
) -> dict[str, Any]:
    """Per-method metrics over ``sample_ids``; ``methods`` maps name -> engine method."""
    ids = set(sample_ids)
    mine = {name: [r for r in rows if r["method"] == name and r["sample_id"] in ids]
            for name in methods}
    baselines = {kind: find_baseline(methods, kind) for kind in BASELINES}
    correct = {name: {r["sample_id"]: r["correct"] for r in rs} for name, rs in mine.items()}
    drafter = correct.get(baselines["drafter"]) if baselines["drafter"] else None
    target = correct.get(baselines["target"]) if baselines["target"] else None
    stats = {name: {"method": methods[name], **method_stats(rs)} for name, rs in mine.items()}
    target_speed = stats[baselines["target"]]["tokens_per_second"] if target else None
    for name, s in stats.items():
        s["speedup"] = (s["tokens_per_second"] / target_speed
                        if target_speed and s["tokens_per_second"] is not None else None)
        s["non_nested_recovery"] = non_nested_recovery(correct[name], drafter, target)
    return {
        "num_samples": len(sample_ids),
        "baselines": baselines,
        "non_nested_problems": len(non_nested_problems(drafter, target)),
        "methods": stats,
    }


# ---------------------------------------------------------------------------- report


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


COLUMNS = (
    ("method", None), ("engine", None), ("n", None), ("accuracy", ".3f"),
    ("tokens/s", ".1f"), ("speedup", ".2f"), ("mean accepted length", ".2f"),
    ("acceptance", ".3f"), ("target fwd/token", ".3f"), ("arbiter accept", ".3f"),
    ("non-nested recovery", ".3f"),
)
_KEYS = ("accuracy", "tokens_per_second", "speedup", "mean_accepted_length", "acceptance_rate",
         "target_forwards_per_token", "arbiter_accept_rate", "non_nested_recovery")


def markdown_table(summary: dict[str, Any]) -> str:
    """The per-method table (markdown), as printed at the end of a run."""
    lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |",
             "|" + "|".join("---" if i < 2 else "---:" for i in range(len(COLUMNS))) + "|"]
    for name, s in summary["methods"].items():
        cells = [name, s["method"], str(s["num_samples"])]
        cells += [_fmt(s[key], spec) for key, (_, spec) in zip(_KEYS, COLUMNS[3:], strict=True)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_report(summary: dict[str, Any]) -> str:
    """A report a person can read: settings, the table, definitions, groups, plots."""
    config = summary.get("config", {})
    baselines = summary["baselines"]
    out = [f"# Evaluation: {config.get('benchmark', 'benchmark')}", ""]
    if config:
        drafters = ", ".join(f"`{d}`" for d in config["drafters"]) or "none"
        out += [
            f"- samples: {summary['num_samples']} (limit {config['limit']}, seed "
            f"{config['seed']}), prompt style {config['prompt_style']}",
            f"- target `{config['target']}`; drafters {drafters}",
            f"- max_new_tokens {config['max_new_tokens']}, batch_size {config['batch_size']}, "
            f"dtype {config['dtype']}, device {summary.get('device', config['device'])}",
        ]
    out += [f"- target-only baseline: {_name(baselines['target'])}; drafter-only baseline: "
            f"{_name(baselines['drafter'])}", "", markdown_table(summary), ""]
    out += [
        "Speedup is tokens/s over the target-only method in this run. Mean accepted length "
        "is 1 + accepted draft tokens / rounds (methods that draft). Arbiter accept is the "
        "share of mismatches the arbiter judged that it accepted. Non-nested recovery: of the "
        f"{summary['non_nested_problems']} problems the drafter-only method solves and the "
        "target-only method does not, the share each method solves.",
        "",
    ]
    groups = {name: s["accuracy_by_group"] for name, s in summary["methods"].items()
              if s["accuracy_by_group"]}
    if groups:
        names = sorted({g for by in groups.values() for g in by})
        out += ["## Accuracy by group", "", "| method | " + " | ".join(names) + " |",
                "|---|" + "---:|" * len(names)]
        out += [f"| {m} | " + " | ".join(_fmt(by.get(g), ".3f") for g in names) + " |"
                for m, by in groups.items()]
        out.append("")
    out += ["## Plots", "", f"![accuracy vs speedup]({ACCURACY_VS_SPEEDUP})", "",
            f"![acceptance by block position]({ACCEPTANCE_BY_POSITION})", ""]
    return "\n".join(out)


def _name(name: str | None) -> str:
    return f"`{name}`" if name else "none in this run"


# ----------------------------------------------------------------------------- plots


def plot_accuracy_vs_speedup(summary: dict[str, Any], path: Path) -> None:
    """Each method as a point: speedup over target-only (tokens/s without one) vs accuracy."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state (Agg canvas)

    methods = summary["methods"]
    use_speedup = summary["baselines"]["target"] is not None
    fig = Figure(figsize=(6, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for name, s in methods.items():
        x = s["speedup"] if use_speedup else s["tokens_per_second"]
        if x is None or s["accuracy"] is None:
            continue
        ax.scatter([x], [s["accuracy"]], s=50)
        ax.annotate(name, (x, s["accuracy"]), textcoords="offset points", xytext=(5, 5))
    if use_speedup:
        ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.margins(0.15)  # room for the labels
    ax.set_xlabel("speedup over target-only" if use_speedup else "tokens/s")
    ax.set_ylabel("accuracy")
    ax.set_title(f"Accuracy vs speed ({summary['num_samples']} samples)")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)


def plot_acceptance_by_position(summary: dict[str, Any], path: Path) -> None:
    """Share of drafting rounds that accepted the draft token at each block position."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4.5), layout="constrained")
    ax = fig.add_subplot()
    width = 0
    for name, s in summary["methods"].items():
        rates = s["acceptance_by_position"]
        if rates:
            label = f"{name} (MAL {_fmt(s['mean_accepted_length'], '.2f')})"
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
            width = max(width, len(rates))
    if width:
        ax.set_xticks(range(1, width + 1))
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no speculative method in this run", ha="center",
                transform=ax.transAxes)
    ax.set_xlabel("block position")
    ax.set_ylabel("share of rounds accepting this position")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by block position")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)


def write_report(summary: dict[str, Any], out_dir: Path) -> None:
    """``summary.json``, ``report.md`` and the two plots into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown_report(summary))
    plot_accuracy_vs_speedup(summary, out_dir / ACCURACY_VS_SPEEDUP)
    plot_acceptance_by_position(summary, out_dir / ACCEPTANCE_BY_POSITION)
