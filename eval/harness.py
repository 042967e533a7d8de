"""``cospec eval --config configs/eval/NAME.yaml``: every method on the same prompts.

Reads top to bottom: load the config -> load every model once -> turn the benchmark into
:class:`EvalItem` objects (toy task families and real benchmarks behind one interface) ->
for each method, build an engine from the shared models and decode the prompts that
``samples.jsonl`` does not hold yet, a chunk of ``batch_size`` prompts at a time, grading
each chunk and appending its rows before the next one starts -> summarise, write the
report and the plots (:mod:`eval.report`).

A method entry is a name plus engine settings: every :class:`~cospec.engine.EngineConfig`
field is a valid key, so a method the engine learns (a new field) joins by config alone.
Models are built into engines by :func:`build_engine`, the one place that knows the
engine's constructor.

Resuming is free: rerun the same command and the (method, sample id) pairs already in
``samples.jsonl`` are skipped. A torn last line (a run killed mid-write) is cut off first.
Each row stores its share of its chunk's wall time, so tokens/s over a resumed run is still
total tokens over total decoding time.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any

import yaml
from tqdm.auto import tqdm

from cospec.engine import Engine, EngineConfig, SequenceResult
from cospec.errors import CoSpecError
from cospec.toy import tasks
from eval import graders
from eval.benchmarks import BENCHMARKS, STOP_STRINGS, BenchmarkSample, chat_prompt, load_benchmark
from eval.report import summarize, write_report

if typing.TYPE_CHECKING:  # transformers is imported by the engine anyway; types only here
    from transformers import PreTrainedModel
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

TOY_BENCHMARKS = {"toy_math": "math", "toy_string": "string"}
BENCHMARK_NAMES = (*TOY_BENCHMARKS, *BENCHMARKS)
HUB_SOURCES = {
    "gsm8k": "openai/gsm8k",
    "math500": "HuggingFaceH4/MATH-500",
    "humaneval": "openai/openai_humaneval",
    "mbpp": "google-research-datasets/mbpp",
}
PROMPT_STYLES = ("base", "chat")
TOY_DEFAULT_LIMIT = 500
# Models are loaded once and shared by every method, so these are settings of the run.
LOAD_SETTINGS = ("dtype", "attn_implementation")
# Keys of a method entry that name models; every other key is an EngineConfig field.
MODEL_KEYS = ("drafters", "arbiter", "slim_verifier_mask")
SAMPLES_FILE = "samples.jsonl"
WARMUP_TOKENS = 16


# ------------------------------------------------------------------------------ config


@dataclass
class MethodSpec:
    """One method of the run: a name, its models and its engine settings.

    ``arbiter`` and ``slim_verifier_mask`` are paths, as in ``Engine.from_pretrained``.
    """

    name: str = field(metadata={"help": "label in the samples, the summary and the plots"})
    drafters: list[str] | None = field(
        default=None, metadata={"help": "drafter paths for this method (default: the run's)"}
    )
    arbiter: str | None = field(
        default=None,
        metadata={"help": "CoSpec arbiter directory; it runs on this method's first drafter"},
    )
    slim_verifier_mask: str | None = field(
        default=None, metadata={"help": "VIA-SD routing mask; the slim verifier is cut from "
                                        "the target"},
    )
    engine: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "EngineConfig settings (method, num_draft_tokens, temperature, ...)"},
    )

    @classmethod
    def from_dict(cls, entry: Any, index: int) -> MethodSpec:
        """A config entry ``{name, <model paths>, <EngineConfig field>: value, ...}``."""
        if not isinstance(entry, dict):
            raise CoSpecError(f"methods[{index}] must be a mapping, got {entry!r}")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise CoSpecError(f"methods[{index}] needs a 'name' (a non-empty string)")
        if "method" not in entry:
            raise CoSpecError(f"method {name!r} needs a 'method' (one of the engine's methods)")
        hints = typing.get_type_hints(cls)
        models = {k: v for k, v in entry.items() if k in MODEL_KEYS}
        for key, value in models.items():
            _check_value(f"method {name!r}: {key}", value, hints[key])
        engine = {k: v for k, v in entry.items() if k not in MODEL_KEYS and k != "name"}
        _check_engine_settings(f"method {name!r}", engine)
        return cls(name=name, engine=engine, **models)

    def to_dict(self) -> dict[str, Any]:
        """The config entry this spec was read from (unset model paths left out)."""
        models = {k: getattr(self, k) for k in MODEL_KEYS if getattr(self, k) is not None}
        return {"name": self.name, **models, **self.engine}


@dataclass
class EvalConfig:
    """One evaluation run: a benchmark, the models, and the methods compared on it."""

    methods: list[MethodSpec] = field(
        metadata={"help": "methods compared: {name, method, drafters?, any EngineConfig field}"}
    )
    benchmark: str = field(
        default="toy_math", metadata={"help": f"one of {', '.join(BENCHMARK_NAMES)}"}
    )
    source: str | None = field(
        default=None,
        metadata={"help": "JSONL path (relative to the working directory) or Hub id of the "
                          "benchmark data (default: its Hub id); toy benchmarks take none"},
    )
    limit: int | None = field(
        default=None,
        metadata={"help": f"first N samples (toy: N problems drawn, {TOY_DEFAULT_LIMIT} if unset)"},
    )
    seed: int = field(
        default=0, metadata={"help": "toy problem draw, and the engines' sampling seed"}
    )
    target: str = field(default="toy:target", metadata={"help": "target path, Hub id or toy:NAME"})
    drafters: list[str] = field(
        default_factory=list, metadata={"help": "drafter paths used by methods that name none"}
    )
    prompt_style: str = field(
        default="base",
        metadata={"help": "base (completion prompt, few-shot, benchmark stop strings) or chat "
                          "(the tokenizer's chat template, stop at end of turn)"},
    )
    output_dir: str = field(
        default="runs/eval", metadata={"help": "samples.jsonl, summary.json, report.md, plots"}
    )
    max_new_tokens: int = field(default=256, metadata={"help": "tokens generated per prompt"})
    batch_size: int = field(
        default=16, metadata={"help": "prompts decoded together; rows are written per batch"}
    )
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "sdpa or eager"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N or auto"})
    engine: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "EngineConfig settings shared by every method (a method's own win)"},
    )
    warmup: bool = field(
        default=True,
        metadata={"help": f"decode one prompt ({WARMUP_TOKENS} tokens) per method before timing"},
    )

    def __post_init__(self) -> None:
        self.methods = [m if isinstance(m, MethodSpec) else MethodSpec.from_dict(m, i)
                        for i, m in enumerate(self.methods)]
        if self.benchmark not in BENCHMARK_NAMES:
            raise CoSpecError(
                f"unknown benchmark {self.benchmark!r}; choose from {list(BENCHMARK_NAMES)}"
            )
        if self.prompt_style not in PROMPT_STYLES:
            raise CoSpecError(
                f"unknown prompt_style {self.prompt_style!r}; choose from {list(PROMPT_STYLES)}"
            )
        if self.is_toy and self.prompt_style != "base":
            raise CoSpecError("toy benchmarks have base prompts only; set prompt_style: base")
        if self.is_toy and self.source is not None:
            raise CoSpecError(f"{self.benchmark} draws its own problems; remove 'source'")
        if self.limit is not None and self.limit < 1:
            raise CoSpecError(f"limit must be >= 1, got {self.limit}")
        if not self.methods:
            raise CoSpecError("the config lists no methods")
        _check_engine_settings("engine", self.engine)
        names = [m.name for m in self.methods]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise CoSpecError(f"method names must be unique; repeated: {duplicated}")
        for spec in self.methods:  # fail on a bad method before any model is loaded
            self.engine_config(spec)

    @property
    def is_toy(self) -> bool:
        return self.benchmark in TOY_BENCHMARKS

    @classmethod
    def from_dict(cls, data: Any) -> EvalConfig:
        """Build from parsed YAML; an unknown key is an error that names it."""
        if not isinstance(data, dict):
            raise CoSpecError(f"an eval config must be a mapping, got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        known = [f.name for f in dataclasses.fields(cls)]
        for key, value in data.items():
            if key not in known:
                raise CoSpecError(f"unknown eval config key {key!r}; known keys: {known}")
            if key != "methods":
                _check_value(key, value, hints[key])
        if not isinstance(data.get("methods"), list):
            raise CoSpecError("the eval config needs 'methods': a list of {name, method, ...}")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> EvalConfig:
        """Read a YAML file; ``overrides`` (CLI flags) replace its keys when not None."""
        path = Path(path)
        if not path.is_file():
            raise CoSpecError(f"eval config {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise CoSpecError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from err
        if isinstance(data, dict):
            data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(data)

    def method_drafters(self, spec: MethodSpec) -> list[str]:
        return list(self.drafters if spec.drafters is None else spec.drafters)

    def engine_settings(self, spec: MethodSpec) -> dict[str, Any]:
        """The EngineConfig keyword arguments of ``spec``: run < ``engine`` < method."""
        stops = list(STOP_STRINGS[self.benchmark]) if (
            not self.is_toy and self.prompt_style == "base") else []
        return {
            "max_new_tokens": self.max_new_tokens, "batch_size": self.batch_size,
            "seed": self.seed, "stop_strings": stops, "dtype": self.dtype,
            "attn_implementation": self.attn_implementation, **self.engine, **spec.engine,
        }

    def engine_config(self, spec: MethodSpec, **overrides: Any) -> EngineConfig:
        try:
            return EngineConfig(**{**self.engine_settings(spec), **overrides})
        except CoSpecError as err:
            raise CoSpecError(f"method {spec.name!r}: {err}") from err

    def settings_id(self, spec: MethodSpec) -> str:
        """Fingerprint of what decides a method's completions (batch size aside).

        Stored in every row: resuming with changed settings under the same method name
        would silently mix two methods in one summary, so it is refused instead.
        """
        settings = {k: v for k, v in self.engine_settings(spec).items() if k != "batch_size"}
        blob = {"settings": settings, "target": self.target, "drafters": self.method_drafters(spec),
                "arbiter": spec.arbiter, "slim_verifier_mask": spec.slim_verifier_mask,
                "benchmark": self.benchmark, "prompt_style": self.prompt_style}
        return _digest(json.dumps(blob, sort_keys=True))

    def to_dict(self) -> dict[str, Any]:
        """The config as YAML would hold it: ``from_dict(to_dict())`` gives it back."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return out | {"methods": [spec.to_dict() for spec in self.methods]}


def _check_engine_settings(where: str, settings: dict[str, Any]) -> None:
    hints = typing.get_type_hints(EngineConfig)
    for key, value in settings.items():
        if key in LOAD_SETTINGS:
            raise CoSpecError(f"{where}: set {key!r} at the top level (models are loaded once "
                              "and shared by every method)")
        if key not in hints:
            raise CoSpecError(f"{where}: unknown key {key!r}; a method takes name, "
                              f"{', '.join(MODEL_KEYS)} and EngineConfig fields {sorted(hints)}")
        _check_value(f"{where}: {key}", value, hints[key])


def _check_value(where: str, value: Any, hint: Any) -> None:
    if not _matches(value, hint):
        name = getattr(hint, "__name__", None) or str(hint)
        raise CoSpecError(f"{where} must be {name}, got {value!r}")


def _matches(value: Any, hint: Any) -> bool:
    """A small isinstance for the annotations configs use (scalars, lists, dicts, unions)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items())
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return not isinstance(hint, type) or isinstance(value, hint)


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


# -------------------------------------------------------------------------- benchmarks


@dataclass(frozen=True)
class EvalItem:
    """One prompt and how to grade its completion, whatever the benchmark.

    ``group`` breaks accuracy down in the report (toy kind, MATH subject; empty if none).
    ``grader`` maps a completion to (correct, JSON-ready details).
    """

    id: str
    prompt: str
    group: str
    grader: Callable[[str], tuple[bool, dict[str, Any]]] = field(repr=False, compare=False)

    @property
    def prompt_id(self) -> str:
        """Fingerprint of the prompt text: a resumed run must decode the same prompts."""
        return _digest(self.prompt)


def _grade_toy(problem: tasks.Problem, completion: str) -> tuple[bool, dict[str, Any]]:
    extracted = tasks.extract_answer(completion)
    return tasks.grade(problem, completion), {"gold": problem.answer, "extracted": extracted}


def _grade_benchmark(sample: BenchmarkSample, completion: str) -> tuple[bool, dict[str, Any]]:
    result = graders.grade(sample, completion)
    return result.correct, result.details


def load_items(config: EvalConfig, tokenizer: PreTrainedTokenizerBase) -> list[EvalItem]:
    """The run's prompts: toy problems from the test split, or a benchmark's samples."""
    if config.is_toy:
        family = TOY_BENCHMARKS[config.benchmark]
        problems = tasks.generate(family, "test", config.limit or TOY_DEFAULT_LIMIT, config.seed)
        return [EvalItem(f"{config.benchmark}/{i}", p.prompt, p.kind, partial(_grade_toy, p))
                for i, p in enumerate(problems)]
    source = config.source or HUB_SOURCES[config.benchmark]
    samples = load_benchmark(config.benchmark, source, config.limit)
    return [
        EvalItem(
            s.id,
            chat_prompt(s, tokenizer) if config.prompt_style == "chat" else s.prompt,
            str(s.metadata.get("subject", "")),
            partial(_grade_benchmark, s),
        )
        for s in samples
    ]


# ------------------------------------------------------------------------------ models


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CoSpecError(f"device {device!r} requested but CUDA is not available")
    return device


class ModelPool:
    """Every model of the run, each loaded once on first use and shared between methods.

    An arbiter's adapter is injected into its drafter's modules in place, so each arbiter
    gets its own copy of its drafter: a shared drafter would draft with the adapter on in
    the methods that have no arbiter.
    """

    def __init__(self, config: EvalConfig) -> None:
        from cospec.models import check_same_vocabulary, load_tokenizer

        self.config = config
        self.device = resolve_device(config.device)
        self.tokenizer = load_tokenizer(config.target)
        drafters = {p for spec in config.methods for p in config.method_drafters(spec)}
        for path in sorted(drafters):  # fail before any decoding, not between methods
            check_same_vocabulary(self.tokenizer, load_tokenizer(path), path)
        self._models: dict[str, PreTrainedModel] = {}
        self._arbiters: dict[tuple[str, str | None], Any] = {}
        self._slims: dict[str, PreTrainedModel] = {}

    def _load(self, path: str) -> PreTrainedModel:
        from cospec.models import load_model

        cfg = self.config
        return load_model(path, dtype=cfg.dtype, device=self.device,
                          attn_implementation=cfg.attn_implementation)

    def model(self, path: str) -> PreTrainedModel:
        if path not in self._models:
            self._models[path] = self._load(path)
        return self._models[path]

    @property
    def target(self) -> PreTrainedModel:
        return self.model(self.config.target)

    def arbiter(self, path: str, drafter: str | None) -> Any:
        """The arbiter in ``path`` on its own copy of ``drafter`` (its recorded base if None)."""
        from cospec.arbiter import ArbiterModel

        key = (path, drafter)
        if key not in self._arbiters:
            cfg = self.config
            base = self._load(drafter) if drafter is not None else None
            self._arbiters[key] = ArbiterModel.load(
                path, base, dtype=cfg.dtype, device=self.device,
                attn_implementation=cfg.attn_implementation)
        return self._arbiters[key]

    def slim_verifier(self, mask_path: str) -> PreTrainedModel:
        """The target with the mask's sublayers skipped (it shares the target's weights)."""
        from cospec.slim import RoutingMask, build_slim_verifier

        if mask_path not in self._slims:
            self._slims[mask_path] = build_slim_verifier(self.target, RoutingMask.load(mask_path))
        return self._slims[mask_path]


def build_engine(
    config: EvalConfig, spec: MethodSpec, pool: ModelPool, **overrides: Any
) -> Engine:
    """An engine for ``spec`` from the pool's models; ``overrides`` change EngineConfig fields.

    The one place that knows the engine's constructor: a new kind of model a method needs
    is a new :data:`MODEL_KEYS` entry, a :class:`ModelPool` loader and a line here.
    """
    paths = config.method_drafters(spec)
    drafters = [pool.model(p) for p in paths]
    arbiter = None
    if spec.arbiter is not None:
        arbiter = pool.arbiter(spec.arbiter, paths[0] if paths else None)
        drafters[:1] = [arbiter.peft_model.get_base_model()]
    slim = pool.slim_verifier(spec.slim_verifier_mask) if spec.slim_verifier_mask else None
    try:
        return Engine(pool.target, pool.tokenizer, drafters,
                      config.engine_config(spec, **overrides), arbiter=arbiter,
                      slim_verifier=slim)
    except CoSpecError as err:
        raise CoSpecError(f"method {spec.name!r}: {err}") from err


# ----------------------------------------------------------------------------- samples


def read_samples(path: Path) -> list[dict[str, Any]]:
    """Rows of ``samples.jsonl``, first row per (method, sample id) kept.

    A last line without its newline is a write cut short by a kill: it is dropped and the
    file truncated to the last complete row, so appending starts on a clean line.
    """
    if not path.is_file():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for line_no, line in enumerate(data[:end].decode().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            key = (row["method"], row["sample_id"])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CoSpecError(f"{path}:{line_no}: not a sample row ({err}); fix or remove "
                              "the line") from err
        rows.setdefault(key, row)
    return list(rows.values())


def check_resumable(rows: list[dict[str, Any]], items: list[EvalItem], config: EvalConfig) -> None:
    """Refuse to mix rows made from other prompts or other method settings."""
    prompt_ids = {item.id: item.prompt_id for item in items}
    settings = {spec.name: config.settings_id(spec) for spec in config.methods}
    for row in rows:
        sample_id = row["sample_id"]
        if sample_id in prompt_ids and row.get("prompt_id") != prompt_ids[sample_id]:
            raise CoSpecError(
                f"{config.output_dir}/{SAMPLES_FILE} holds sample {sample_id!r} with a different "
                "prompt (benchmark, seed or prompt style changed); use a new output_dir")
    for row in rows:
        name = row["method"]
        if name in settings and row.get("settings_id") != settings[name]:
            raise CoSpecError(
                f"{config.output_dir}/{SAMPLES_FILE} holds rows of method {name!r} made with "
                "other settings; use a new output_dir or rename the method")


def sample_row(
    name: str, settings_id: str, item: EvalItem, seq: SequenceResult, seconds: float,
    target_forwards: float,
) -> dict[str, Any]:
    """One graded completion with the counts the summary needs, all from the trace."""
    correct, details = item.grader(seq.text)
    by_position = [0] * max((len(r.draft_tokens) for r in seq.rounds), default=0)
    for r in seq.rounds:
        for j in range(r.accepted):
            by_position[j] += 1
    decisions = [d for r in seq.rounds for d in r.arbiter_decisions]
    return {
        "method": name, "sample_id": item.id, "prompt_id": item.prompt_id,
        "settings_id": settings_id, "group": item.group, "completion": seq.text,
        "correct": bool(correct), "grade": details, "tokens": len(seq.token_ids),
        "rounds": _rounds(seq), "draft_rounds": sum(1 for r in seq.rounds if r.draft_tokens),
        "drafted": sum(len(r.draft_tokens) for r in seq.rounds), "accepted": seq.accepted,
        "accepted_per_position": by_position,
        "mismatches": sum(len(r.mismatches) for r in seq.rounds),
        "arbiter_decisions": len(decisions), "arbiter_accepts": sum(map(bool, decisions)),
        "target_forwards": target_forwards, "finish_reason": seq.finish_reason,
        "seconds": seconds,
    }


def _rounds(seq: SequenceResult) -> int:
    """Rounds of a sequence; autoregressive decoding keeps no trace and emits one a round."""
    return len(seq.rounds) if seq.rounds else len(seq.token_ids)


def decode_chunk(
    engine: Engine, name: str, settings_id: str, chunk: Sequence[EvalItem]
) -> list[dict[str, Any]]:
    """Decode and grade one chunk; its time and target forwards are shared out per row.

    Time is split evenly (rows of a batch decode together); target forwards in proportion
    to each row's rounds, which is exact when each round is one target row forward.
    """
    output = engine.generate([item.prompt for item in chunk])
    stats = output.stats
    seconds = stats.seconds["total"] / len(chunk)
    rounds = [_rounds(seq) for seq in output.sequences]
    per_round = stats.target_row_forwards / max(1, sum(rounds))
    return [
        sample_row(name, settings_id, item, seq, seconds, per_round * n)
        for item, seq, n in zip(chunk, output.sequences, rounds, strict=True)
    ]


def _append(f: IO[str], rows: list[dict[str, Any]]) -> None:
    f.write("".join(json.dumps(row) + "\n" for row in rows))
    f.flush()
    os.fsync(f.fileno())


def run_method(
    config: EvalConfig,
    spec: MethodSpec,
    pool: ModelPool,
    items: list[EvalItem],
    done: dict[str, bool],
    f: IO[str],
) -> list[dict[str, Any]]:
    """Decode the items ``done`` (sample id -> correct) lacks; rows are written per chunk.

    One engine decodes every chunk (models and settings are built once); the warm-up runs
    on a separate engine. Bandit state is per query, so it never carries between chunks.
    """
    engine = build_engine(config, spec, pool)
    settings_id = config.settings_id(spec)
    pending = [item for item in items if item.id not in done]
    correct = dict(done)
    bar = tqdm(total=len(items), initial=len(items) - len(pending), desc=spec.name,
               unit="sample", dynamic_ncols=True)
    if correct:
        bar.set_postfix(acc=f"{sum(correct.values()) / len(correct):.3f}")
    if pending and config.warmup:
        warm = build_engine(config, spec, pool, max_new_tokens=WARMUP_TOKENS, batch_size=1)
        warm.generate([pending[0].prompt])
    size = engine.config.batch_size
    rows: list[dict[str, Any]] = []
    for begin in range(0, len(pending), size):
        chunk_rows = decode_chunk(engine, spec.name, settings_id, pending[begin:begin + size])
        _append(f, chunk_rows)
        rows += chunk_rows
        correct.update((r["sample_id"], r["correct"]) for r in chunk_rows)
        bar.update(len(chunk_rows))
        bar.set_postfix(acc=f"{sum(correct.values()) / len(correct):.3f}")
    bar.close()
    return rows


# --------------------------------------------------------------------------------- run


def run_eval(config: EvalConfig) -> dict[str, Any]:
    """Run (or resume) every method; write samples, summary, report and plots; the summary."""
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    pool = ModelPool(config)
    items = load_items(config, pool.tokenizer)
    samples_path = out / SAMPLES_FILE
    rows = read_samples(samples_path)
    check_resumable(rows, items, config)
    item_ids = {item.id for item in items}
    with samples_path.open("a", encoding="utf-8") as f:
        for spec in config.methods:
            done = {r["sample_id"]: r["correct"] for r in rows
                    if r["method"] == spec.name and r["sample_id"] in item_ids}
            if all(item.id in done for item in items):
                continue
            rows += run_method(config, spec, pool, items, done, f)
    methods = {spec.name: config.engine_config(spec).method for spec in config.methods}
    summary = summarize(rows, methods, [item.id for item in items])
    summary["device"] = pool.device
    summary["config"] = config.to_dict()
    write_report(summary, out)
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cospec eval", description="Evaluate methods on a benchmark (resumable).")
    parser.add_argument("--config", required=True, help="eval config YAML (configs/eval/)")
    parser.add_argument("--output-dir", help="override the config's output_dir")
    parser.add_argument("--limit", type=int, help="override the config's limit")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Entry point of ``cospec eval``; bad input raises :class:`CoSpecError`."""
    args = build_parser().parse_args(argv)
    config = EvalConfig.from_yaml(args.config, output_dir=args.output_dir, limit=args.limit)
    summary = run_eval(config)
    from eval.report import markdown_table

    print(markdown_table(summary))
    print(f"wrote {config.output_dir}/{{{SAMPLES_FILE}, summary.json, report.md, *.png}}")
    return summary


if __name__ == "__main__":
    try:
        main()
    except CoSpecError as err:
        print(f"cospec eval: error: {err}", file=sys.stderr)
        sys.exit(2)
