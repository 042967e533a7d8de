"""The evaluation harness: a toy run end to end, resume after a kill, config errors, metrics.

References: greedy vanilla SPD must reproduce target-only decoding exactly (completions and
accuracy); a resumed run must summarise like the uninterrupted one; the metrics are checked
against hand-worked examples.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cospec.errors import CoSpecError
from cospec.toy.world import MODEL_NAMES, WORLD_DIR
from eval.harness import (
    SAMPLES_FILE,
    EvalConfig,
    load_items,
    main,
    read_samples,
    run_eval,
)
from eval.report import non_nested_recovery, summarize
from trainers.toy_pretrain import build_world

LIMIT = 12
# Compared between an uninterrupted and a resumed run; timings (tokens/s, speedup) differ.
EXACT_METRICS = ("num_samples", "correct", "accuracy", "tokens", "mean_accepted_length",
                 "acceptance_rate", "target_forwards_per_token", "arbiter_accept_rate",
                 "non_nested_recovery", "acceptance_by_position", "accuracy_by_group",
                 "finish_reasons")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The shipped toy world when present, else a micro world (3 training steps)."""
    if all((WORLD_DIR / name / "model.safetensors").is_file() for name in MODEL_NAMES):
        return WORLD_DIR
    path = tmp_path_factory.mktemp("world")
    build_world(path, max_steps=3, workers=1)
    return path


def toy_config(world: Path, output_dir: Path, **changes) -> dict:
    config = {
        "benchmark": "toy_math", "limit": LIMIT, "seed": 0,
        "target": str(world / "target"), "drafters": [str(world / "drafter_math")],
        "output_dir": str(output_dir), "max_new_tokens": 40, "batch_size": 5,
        "engine": {"temperature": 0.0},
        "methods": [
            {"name": "target", "method": "target"},
            {"name": "drafter", "method": "drafter"},
            {"name": "spd", "method": "spd", "num_draft_tokens": 4},
        ],
    }
    config.update(changes)
    return config


@pytest.fixture(scope="module")
def toy_run(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "toy"
    summary = run_eval(EvalConfig.from_dict(toy_config(world, out)))
    return out, summary


def by_key(rows: list[dict]) -> dict[tuple[str, str], dict]:
    return {(r["method"], r["sample_id"]): r for r in rows}


def test_toy_run_writes_every_output(toy_run):
    out, summary = toy_run
    for name in (SAMPLES_FILE, "summary.json", "report.md", "accuracy_vs_speedup.png",
                 "acceptance_by_position.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    lines = (out / SAMPLES_FILE).read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 3 * LIMIT == len(by_key(rows))
    assert json.loads((out / "summary.json").read_text())["methods"] == summary["methods"]
    methods = summary["methods"]
    assert list(methods) == ["target", "drafter", "spd"]
    assert summary["baselines"] == {"target": "target", "drafter": "drafter"}
    assert methods["target"]["speedup"] == pytest.approx(1.0)
    assert methods["target"]["target_forwards_per_token"] == pytest.approx(1.0)
    assert methods["drafter"]["target_forwards_per_token"] == 0.0
    assert methods["target"]["mean_accepted_length"] is None  # nothing drafted
    assert 1.0 <= methods["spd"]["mean_accepted_length"] <= 5.0
    assert len(methods["spd"]["acceptance_by_position"]) == 4
    assert methods["spd"]["arbiter_accept_rate"] is None  # no arbiter ran
    report = (out / "report.md").read_text()
    assert "| spd | spd |" in report and "accuracy_vs_speedup.png" in report


def test_greedy_spd_reproduces_target_only(toy_run):
    out, summary = toy_run
    rows = by_key(read_samples(out / SAMPLES_FILE))
    for i in range(LIMIT):
        target, spd = rows[("target", f"toy_math/{i}")], rows[("spd", f"toy_math/{i}")]
        assert spd["completion"] == target["completion"]
        assert spd["correct"] == target["correct"]
    methods = summary["methods"]
    assert methods["spd"]["accuracy"] == methods["target"]["accuracy"]
    spd_fwd = methods["spd"]["target_forwards_per_token"]
    assert spd_fwd == pytest.approx(1 / methods["spd"]["mean_accepted_length"], rel=0.2)


def test_resume_after_a_kill_mid_write(world, toy_run, tmp_path):
    out, summary = toy_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    lines = (resumed / SAMPLES_FILE).read_text().splitlines(keepends=True)
    keep = 2 * LIMIT + 3  # target and drafter rows, three spd rows, then a torn line
    torn = lines[keep][: len(lines[keep]) // 2]
    (resumed / SAMPLES_FILE).write_text("".join(lines[:keep]) + torn)

    again = run_eval(EvalConfig.from_dict(toy_config(world, resumed)))
    rows = [json.loads(line) for line in (resumed / SAMPLES_FILE).read_text().splitlines()]
    assert len(rows) == 3 * LIMIT == len(by_key(rows))  # no duplicate (method, id)
    original = by_key(read_samples(out / SAMPLES_FILE))
    for key, row in by_key(rows).items():
        assert row["completion"] == original[key]["completion"], key
    for name, metrics in summary["methods"].items():
        for metric in EXACT_METRICS:
            assert again["methods"][name][metric] == metrics[metric], (name, metric)
        assert again["methods"][name]["tokens_per_second"] > 0
    # A rerun with nothing left to do decodes nothing and writes nothing new.
    before = (resumed / SAMPLES_FILE).read_bytes()
    stored = json.loads((resumed / "summary.json").read_text())["config"]
    run_eval(EvalConfig.from_dict(stored))  # the summary's config reruns the same run
    assert (resumed / SAMPLES_FILE).read_bytes() == before


def test_resume_refuses_changed_settings(world, toy_run, tmp_path):
    out, _ = toy_run
    shutil.copytree(out, tmp_path / "run")
    config = toy_config(world, tmp_path / "run")
    config["methods"][2]["num_draft_tokens"] = 2
    with pytest.raises(CoSpecError, match="'spd' made with other settings"):
        run_eval(EvalConfig.from_dict(config))
    config = toy_config(world, tmp_path / "run", seed=1)
    with pytest.raises(CoSpecError, match="different prompt"):
        run_eval(EvalConfig.from_dict(config))


def test_methods_with_an_arbiter_or_a_slim_verifier(world, toy_run, tmp_path):
    """Model paths in method entries: an arbiter (CoSpec) and a slim verifier (VIA-SD).

    The arbiter's adapter sits in its drafter's modules, so drafter-only decoding in the same
    run must still match a run without an arbiter. A slim verifier that skips nothing is the
    target, and with both VIA-SD thresholds at 1 it settles only the target's own greedy
    tokens, so its completions must equal target-only decoding.
    """
    from peft import LoraConfig

    from cospec.arbiter import ArbiterModel
    from cospec.models import load_model
    from cospec.slim import RoutingMask

    drafter_path = str(world / "drafter_math")
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      init_lora_weights=False)  # random, so the adapter changes the drafter
    ArbiterModel.from_drafter(load_model(drafter_path), num_draft_tokens=4, lora=lora,
                              base_model=drafter_path).save_pretrained(tmp_path / "arbiter")
    num_layers = load_model(str(world / "target")).config.num_hidden_layers
    RoutingMask.none(num_layers).save(tmp_path / "mask.json")
    methods = [
        {"name": "cospec", "method": "spd", "num_draft_tokens": 4,
         "arbiter": str(tmp_path / "arbiter"), "arbiter_mode": "threshold"},
        {"name": "via", "method": "spd", "slim_verifier_mask": str(tmp_path / "mask.json"),
         "alpha_accept": 1.0, "alpha_regen": 1.0},
        {"name": "drafter", "method": "drafter"},
    ]
    summary = run_eval(EvalConfig.from_dict(
        toy_config(world, tmp_path / "out", limit=4, methods=methods)))
    assert summary["methods"]["cospec"]["arbiter_accept_rate"] is not None
    assert summary["baselines"] == {"target": None, "drafter": "drafter"}
    assert summary["methods"]["drafter"]["speedup"] is None
    plain = by_key(read_samples(toy_run[0] / SAMPLES_FILE))
    rows = by_key(read_samples(tmp_path / "out" / SAMPLES_FILE))
    assert len(rows) == 3 * 4
    for (name, sample_id), row in rows.items():
        if name == "drafter":
            assert row["completion"] == plain[(name, sample_id)]["completion"], sample_id
        if name == "via":
            assert row["completion"] == plain[("target", sample_id)]["completion"], sample_id


def test_read_samples_drops_a_torn_last_line(tmp_path):
    path = tmp_path / SAMPLES_FILE
    row = {"method": "m", "sample_id": "a", "correct": True}
    path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n" + '{"method": "m", "sam')
    assert read_samples(path) == [row]  # duplicate dropped too
    assert path.read_text().endswith("}\n")
    path.write_text("not json\n" + json.dumps(row) + "\n")
    with pytest.raises(CoSpecError, match=":1: not a sample row"):
        read_samples(path)


METHODS = [{"name": "target", "method": "target"}]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"batchsize": 4}, "unknown eval config key 'batchsize'"),
        ({"benchmark": "gsm9k"}, "unknown benchmark 'gsm9k'"),
        ({"methods": [{"name": "x", "method": "spd", "k": 4}]}, "method 'x': unknown key 'k'"),
        ({"methods": [{"name": "x", "method": "beam"}]}, "method 'x': unknown method 'beam'"),
        ({"methods": [{"name": "x", "method": "spd", "dtype": "bfloat16"}]},
         "set 'dtype' at the top level"),
        ({"methods": [{"method": "spd"}]}, r"methods\[0\] needs a 'name'"),
        ({"methods": METHODS * 2}, "repeated: \\['target'\\]"),
        ({"limit": "ten"}, "limit must be"),
        ({"engine": {"temperature": "hot"}}, "engine: temperature must be float"),
        ({"prompt_style": "chat"}, "toy benchmarks have base prompts only"),
        ({"source": "data.jsonl"}, "remove 'source'"),
    ],
)
def test_bad_config_is_a_one_line_error(changes, message):
    with pytest.raises(CoSpecError, match=message):
        EvalConfig.from_dict({"methods": METHODS} | changes)


def test_main_reads_yaml_and_names_the_unknown_key(tmp_path):
    path = tmp_path / "eval.yaml"
    path.write_text("benchmark: toy_math\nmethods: [{name: t, method: target}]\ncolour: red\n")
    with pytest.raises(CoSpecError, match="unknown eval config key 'colour'"):
        main(["--config", str(path)])
    with pytest.raises(CoSpecError, match="does not exist"):
        main(["--config", str(tmp_path / "missing.yaml")])


def test_shipped_configs_parse():
    root = Path(__file__).resolve().parents[1] / "configs" / "eval"
    toy = EvalConfig.from_yaml(root / "toy.yaml")
    assert [(m.name, toy.engine_config(m).method) for m in toy.methods] == [
        ("target", "target"), ("drafter", "drafter"), ("spd", "spd")]
    assert toy.limit == 200 and toy.engine_config(toy.methods[2]).greedy
    real = EvalConfig.from_yaml(root / "real_example.yaml", limit=5, output_dir="elsewhere")
    assert real.benchmark == "gsm8k" and real.limit == 5 and real.output_dir == "elsewhere"


def test_real_benchmark_items_share_the_toy_interface(tokenizer):
    source = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k_test.jsonl"
    if not source.is_file():
        pytest.skip(f"offline benchmark file {source} is not present")
    config = EvalConfig.from_dict({"benchmark": "gsm8k", "source": str(source), "limit": 3,
                                   "methods": METHODS})
    items = load_items(config, tokenizer)
    rows = [json.loads(line) for line in source.read_text().splitlines()[:3]]
    assert [item.id for item in items] == ["gsm8k/0", "gsm8k/1", "gsm8k/2"]
    assert items[0].prompt.endswith(f"Question: {rows[0]['question']}\nAnswer:")
    assert config.engine_config(config.methods[0]).stop_strings == ["\n\nQuestion:"]
    for item, row in zip(items, rows, strict=True):
        assert item.grader(" " + row["answer"] + "\n\nQuestion: next")[0]
        assert not item.grader(" no answer here")[0]
    chat = EvalConfig.from_dict({"benchmark": "gsm8k", "source": str(source), "limit": 3,
                                 "prompt_style": "chat", "methods": METHODS})
    with pytest.raises(CoSpecError, match="no chat template"):
        load_items(chat, tokenizer)  # the toy tokenizer has none


def test_non_nested_recovery_hand_example():
    target = {"a": True, "b": False, "c": False, "d": False}
    drafter = {"a": True, "b": True, "c": True, "d": False}
    method = {"a": False, "b": True, "c": False, "d": True}
    # The drafter alone solves b and c; the method recovers b of them.
    assert non_nested_recovery(method, drafter, target) == 0.5
    assert non_nested_recovery(drafter, drafter, target) == 1.0
    assert non_nested_recovery(target, drafter, target) == 0.0
    assert non_nested_recovery(method, None, target) is None
    assert non_nested_recovery(method, drafter, {k: True for k in target}) is None


def _row(method, sample_id, correct, **counts):
    row = {"method": method, "sample_id": sample_id, "correct": correct, "group": "",
           "tokens": 10, "seconds": 1.0, "rounds": 10, "draft_rounds": 0, "drafted": 0,
           "accepted": 0, "accepted_per_position": [], "target_forwards": 10.0,
           "arbiter_decisions": 0, "arbiter_accepts": 0, "finish_reason": "eos"}
    return row | counts


def test_summarize_hand_example():
    rows = [
        _row("t", "a", True), _row("t", "b", False),
        _row("d", "a", False, target_forwards=0.0, seconds=0.25),
        _row("d", "b", True, target_forwards=0.0, seconds=0.25),
        # 2 rows x 4 rounds, K=2: 3 + 2 accepted of 16 drafted; the arbiter ruled on 4
        # mismatches and accepted 1.
        _row("c", "a", True, rounds=4, draft_rounds=4, drafted=8, accepted=3,
             accepted_per_position=[2, 1], target_forwards=4.0, arbiter_decisions=3,
             arbiter_accepts=1, seconds=0.5),
        _row("c", "b", True, rounds=4, draft_rounds=4, drafted=8, accepted=2,
             accepted_per_position=[2, 0], target_forwards=4.0, arbiter_decisions=1,
             seconds=0.5),
        _row("c", "zz", True),  # not in this run's samples: ignored
    ]
    summary = summarize(rows, {"t": "target", "d": "drafter", "c": "spd"}, ["a", "b"])
    assert summary["baselines"] == {"target": "t", "drafter": "d"}
    assert summary["non_nested_problems"] == 1
    t, d, c = (summary["methods"][m] for m in ("t", "d", "c"))
    assert (t["accuracy"], d["accuracy"], c["accuracy"]) == (0.5, 0.5, 1.0)
    assert t["tokens_per_second"] == 10.0 and d["speedup"] == 4.0 and c["speedup"] == 2.0
    assert c["mean_accepted_length"] == 1 + 5 / 8
    assert c["acceptance_rate"] == 5 / 16
    assert c["target_forwards_per_token"] == 8 / 20
    assert c["arbiter_accept_rate"] == 0.25 and t["arbiter_accept_rate"] is None
    assert c["acceptance_by_position"] == [4 / 8, 1 / 8]
    assert (t["non_nested_recovery"], d["non_nested_recovery"], c["non_nested_recovery"]) == (
        0.0, 1.0, 1.0)
