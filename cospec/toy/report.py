"""``cospec toy report``: does the toy world have the properties the system relies on?

On held-out problems, with greedy decoding through the engine: accuracy of every model per
family and per kind, the oracle union of the target with each drafter (the head-room an
arbiter could capture), and each drafter's greedy acceptance and mean accepted length at
K=4 measured by real speculative decoding against the target.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from cospec.engine import Engine, EngineConfig
from cospec.models import load_model, load_tokenizer
from cospec.toy import tasks
from cospec.toy.world import MODEL_NAMES, WORLD_DIR, toy_model_path

DRAFTERS = [name for name in MODEL_NAMES if name != "target"]


def build_report(
    world_dir: Path = WORLD_DIR,
    num_problems: int = 500,
    seed: int = 0,
    num_draft_tokens: int = 4,
    batch_size: int = 64,
    max_new_tokens: int = 64,
) -> dict:
    """Measure accuracy, union and acceptance for every model and family."""
    tokenizer = load_tokenizer(str(toy_model_path("target", world_dir)))
    models = {name: load_model(str(toy_model_path(name, world_dir))) for name in MODEL_NAMES}
    problems = {f: tasks.generate(f, "test", num_problems, seed) for f in tasks.FAMILIES}
    base = dict(batch_size=batch_size, max_new_tokens=max_new_tokens)
    report: dict[str, dict] = {"accuracy": {}, "accuracy_by_kind": {}, "union": {},
                               "acceptance": {}, "mean_accepted_length": {}}
    correct: dict[str, dict[str, list[bool]]] = {}
    jobs = [(name, family) for name in MODEL_NAMES for family in problems]
    for name, family in tqdm(jobs, desc="accuracy"):
        method = "target" if name == "target" else "drafter"
        drafters = [] if name == "target" else [models[name]]
        engine = Engine(models["target"], tokenizer, drafters, EngineConfig(method=method, **base))
        out = engine.generate([p.prompt for p in problems[family]])
        ok = [tasks.grade(p, s.text) for p, s in zip(problems[family], out.sequences,
                                                     strict=True)]
        correct.setdefault(name, {})[family] = ok
        report["accuracy"].setdefault(name, {})[family] = sum(ok) / len(ok)
        report["accuracy_by_kind"].setdefault(name, {})[family] = tasks.per_kind(
            problems[family], ok)
    for name in DRAFTERS:
        for family in problems:
            pairs = zip(correct["target"][family], correct[name][family], strict=True)
            union = [a or b for a, b in pairs]
            report["union"].setdefault(name, {})[family] = sum(union) / len(union)
    spd_jobs = [(name, family) for name in DRAFTERS for family in problems]
    for name, family in tqdm(spd_jobs, desc="acceptance"):
        config = EngineConfig(method="spd", num_draft_tokens=num_draft_tokens, **base)
        stats = Engine(models["target"], tokenizer, [models[name]], config).generate(
            [p.prompt for p in problems[family]]).stats
        report["acceptance"].setdefault(name, {})[family] = stats.acceptance_rate
        report["mean_accepted_length"].setdefault(name, {})[family] = stats.mean_accepted_length
    report["settings"] = {"num_problems": num_problems, "seed": seed,
                          "num_draft_tokens": num_draft_tokens, "world_dir": str(world_dir)}
    return report


def print_report(report: dict, console: Console | None = None) -> None:
    console = console or Console()
    families = list(tasks.FAMILIES)
    table = Table(title="Toy world: held-out accuracy (greedy)")
    table.add_column("model")
    for family in families:
        table.add_column(family, justify="right")
    table.add_column("by kind")
    for name, accs in report["accuracy"].items():
        kinds = report["accuracy_by_kind"][name]
        detail = "  ".join(f"{k} {v:.2f}" for f in families for k, v in kinds[f].items())
        table.add_row(name, *(f"{accs[f]:.3f}" for f in families), detail)
    console.print(table)
    spd = Table(title=f"Drafters vs target (K={report['settings']['num_draft_tokens']})")
    spd.add_column("drafter")
    for family in families:
        spd.add_column(f"{family} union", justify="right")
        spd.add_column(f"{family} accept", justify="right")
        spd.add_column(f"{family} MAL", justify="right")
    for name in report["union"]:
        cells = []
        for family in families:
            cells += [f"{report['union'][name][family]:.3f}",
                      f"{report['acceptance'][name][family]:.3f}",
                      f"{report['mean_accepted_length'][name][family]:.2f}"]
        spd.add_row(name, *cells)
    console.print(spd)


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
