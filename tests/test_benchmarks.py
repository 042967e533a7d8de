"""Benchmark loaders and prompt builders, on the offline copies of the datasets."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from cospec.errors import CoSpecError
from cospec.toy.tokenizer import build_tokenizer
from eval.benchmarks import (
    BENCHMARKS,
    STOP_STRINGS,
    BenchmarkSample,
    chat_prompt,
    load_benchmark,
    truncate_at_stop,
)

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"
FILES = {
    "gsm8k": "gsm8k_test.jsonl",
    "math500": "math500_test.jsonl",
    "humaneval": "humaneval.jsonl",
    "mbpp": "mbpp.jsonl",
}


def _path(name: str) -> Path:
    path = DATA_DIR / FILES[name]
    if not path.is_file():
        pytest.skip(f"offline benchmark file {path} is not present")
    return path


def _rows(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in _path(name).read_text().splitlines()]


@pytest.mark.parametrize(
    ("name", "count", "first_id"),
    [
        ("gsm8k", 1319, "gsm8k/0"),
        ("math500", 500, "test/precalculus/807.json"),
        ("humaneval", 164, "HumanEval/0"),
        ("mbpp", 500, "mbpp/11"),
    ],
)
def test_loaders_read_the_offline_files(name: str, count: int, first_id: str) -> None:
    samples = load_benchmark(name, str(_path(name)))
    assert len(samples) == count
    assert samples[0].id == first_id
    assert len({s.id for s in samples}) == count
    assert all(s.benchmark == name and s.question and s.reference for s in samples)
    assert all(s.question in s.prompt for s in samples)


def test_mbpp_uses_test_ids_and_the_paper_three_shots() -> None:
    samples = load_benchmark("mbpp", str(_path("mbpp")))
    rows = {row["task_id"]: row for row in _rows("mbpp")}
    assert [s.id for s in samples] == [f"mbpp/{i}" for i in range(11, 511)]
    for sample in samples:
        shots, task = sample.prompt.rsplit("You are an expert Python programmer", 1)
        assert [rows[i]["text"] in shots for i in (1, 2, 3, 4, 5)] == [
            False,
            True,
            True,
            True,
            False,
        ]
        assert shots.count("[BEGIN]") == shots.count("[DONE]") == 3
        assert all(test in task for test in sample.metadata["test_list"])
        assert task.endswith("[BEGIN]\n")
        assert "\r" not in sample.prompt


def test_gsm8k_reference_is_the_gold_final_line() -> None:
    samples = load_benchmark("gsm8k", str(_path("gsm8k")))
    for sample, row in zip(samples, _rows("gsm8k"), strict=True):
        assert f"#### {sample.reference}" == row["answer"].splitlines()[-1]
        assert sample.prompt.endswith(f"Question: {row['question']}\nAnswer:")


def test_gsm8k_few_shot_arithmetic_is_right() -> None:
    """The hand-written exemplars teach the answer format; their sums must be correct too."""
    prompt = load_benchmark("gsm8k", str(_path("gsm8k")), limit=1)[0].prompt
    shots = prompt.rsplit("Question:", 1)[0]
    equations = re.findall(r"([\d.]+(?: [-+*/] [\d.]+)+) = ([\d.]+)", shots)
    assert len(equations) >= 8
    for expression, result in equations:
        assert eval(expression) == float(result), expression
    answers = re.findall(r"= ([\d.]+)[^=]*?\n#### (\d+)", shots)
    assert len(answers) == 4 and all(float(a) == float(b) for a, b in answers)


def test_limit_and_argument_errors(tmp_path: Path) -> None:
    assert len(load_benchmark("humaneval", str(_path("humaneval")), limit=3)) == 3
    with pytest.raises(CoSpecError, match="limit must be positive"):
        load_benchmark("humaneval", str(_path("humaneval")), limit=0)
    with pytest.raises(CoSpecError, match=r"unknown benchmark 'gsm9k'.*gsm8k"):
        load_benchmark("gsm9k", str(_path("gsm8k")))
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(CoSpecError, match=re.escape(str(missing))):
        load_benchmark("gsm8k", str(missing))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
    with pytest.raises(CoSpecError, match=re.escape(f"{broken}:2")):
        load_benchmark("gsm8k", str(broken))
    wrong_fields = tmp_path / "wrong.jsonl"
    wrong_fields.write_text('{"question": "q"}\n')
    with pytest.raises(CoSpecError, match="row 0 has no field 'answer'"):
        load_benchmark("gsm8k", str(wrong_fields))
    test_ids_only = tmp_path / "mbpp_test.jsonl"
    test_ids_only.write_text("".join(json.dumps(r) + "\n" for r in _rows("mbpp")[10:20]))
    with pytest.raises(CoSpecError, match=r"ids \[2, 3, 4\].*missing"):
        load_benchmark("mbpp", str(test_ids_only))


# The Hub layouts (configuration, split) each loader asks for, served from the local rows.
HUB_SPLITS = {
    ("gsm8k", "main", "test"): lambda rows: rows,
    ("math500", None, "test"): lambda rows: rows,
    ("humaneval", None, "test"): lambda rows: rows,
    ("mbpp", "full", "test"): lambda rows: [r for r in rows if 11 <= r["task_id"] <= 510],
    ("mbpp", "full", "prompt"): lambda rows: [r for r in rows if 1 <= r["task_id"] <= 10],
}


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_hub_ids_load_the_same_samples(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hub id goes through ``datasets.load_dataset`` and yields what the local file does."""
    import datasets

    requested = []

    def fake_load_dataset(path: str, config: str | None, split: str) -> datasets.Dataset:
        requested.append((path, config, split))
        rows = HUB_SPLITS[(name, config, split)](_rows(name))
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    from_hub = load_benchmark(name, "owner/dataset")
    assert from_hub == load_benchmark(name, str(_path(name)))
    assert {path for path, _, _ in requested} == {"owner/dataset"}


def test_truncate_at_stop_cuts_at_the_earliest_stop() -> None:
    stops = STOP_STRINGS["humaneval"]
    body = "    x = 1\n    # keep indented comments\n    return x\n"
    assert truncate_at_stop(body, stops) == body
    assert truncate_at_stop(body + "\n# top\ndef g():\n", stops) == body
    assert truncate_at_stop("a\nprint(1)\ndef f", stops) == "a"


@pytest.fixture(scope="module")
def chat_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tokenizer


@pytest.mark.parametrize(
    ("name", "asks_for"),
    [
        ("gsm8k", "#### <number>"),
        ("math500", "\\boxed{}"),
        ("humaneval", "```python\n"),
        ("mbpp", "```python code block"),
    ],
)
def test_chat_prompt_applies_the_template(name: str, asks_for: str, chat_tokenizer) -> None:
    sample = load_benchmark(name, str(_path(name)), limit=1)[0]
    prompt = chat_prompt(sample, chat_tokenizer)
    assert prompt.startswith("<user>")
    assert prompt.endswith("</user><assistant>")
    assert sample.question in prompt
    assert asks_for in prompt


def test_chat_prompt_needs_a_chat_template() -> None:
    sample = BenchmarkSample("t/0", "gsm8k", "What is 2 + 2?", "p", "4")
    with pytest.raises(CoSpecError, match="no chat template"):
        chat_prompt(sample, build_tokenizer())
