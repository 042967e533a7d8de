"""The toy world: tasks, tokenizer, the training recipe, the shipped models and bad input."""

from __future__ import annotations

import json

import pytest
import torch

from cospec.cli import main
from cospec.errors import CoSpecError
from cospec.models import check_same_vocabulary, load_model, load_tokenizer
from cospec.toy import tasks
from cospec.toy.tokenizer import build_tokenizer
from cospec.toy.world import SPECS, WORLD_MODEL_NAMES
from trainers.toy_pretrain import build_world, encode_batch, training_examples


@pytest.mark.parametrize("family", list(tasks.FAMILIES))
def test_generators_are_seeded_and_splits_disjoint(family):
    test = tasks.generate(family, "test", 300, seed=0)
    assert test == tasks.generate(family, "test", 300, seed=0)
    assert len({p.question for p in test}) == 300
    train = tasks.generate(family, "train", 3000, seed=1)
    assert not {p.question for p in test} & {p.question for p in train}
    assert {p.kind for p in test} == set(tasks.FAMILIES[family])


@pytest.mark.parametrize("family", list(tasks.FAMILIES))
def test_reference_solutions_grade_correct(family):
    for problem in tasks.generate(family, "test", 200, seed=3):
        assert tasks.grade(problem, problem.solution)
        assert tasks.extract_answer(problem.solution) == problem.answer
        assert not tasks.grade(problem, problem.solution.replace(problem.answer, "x") + "\n")


def test_grader_examples():
    add = tasks.generate("math", "test", 50, seed=0, kind_weights={"add": 1.0})[0]
    assert tasks.grade(add, f" whatever\n#### {add.answer}")
    assert tasks.grade(add, f" 1+1=2\n#### {int(add.answer):,}")
    assert not tasks.grade(add, " no marker")
    assert not tasks.grade(add, f"#### {int(add.answer) + 1}")


def test_math_mixture_follows_weights():
    problems = training_examples(SPECS["target"], 4000, seed=0)
    kinds = [p.kind for p in problems if p.family == "math"]
    assert 0.003 < kinds.count("sub") / len(kinds) < 0.02  # subtraction is rare for the target
    drafter = [p.kind for p in training_examples(SPECS["drafter_math"], 2000, seed=0)]
    assert drafter.count("sub") / len(drafter) > 0.35


def test_tokenizer_round_trip_and_labels(tokenizer):
    problem = tasks.generate("string", "test", 1, seed=0)[0]
    text = problem.prompt + problem.solution
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    ids, _, labels = encode_batch(tokenizer, [problem])
    scored = labels[labels != -100].tolist()
    assert tokenizer.decode(scored[:-1]) == problem.solution
    assert scored[-1] == tokenizer.eos_token_id


def test_micro_world_trains_and_loads(tmp_path):
    logs = build_world(tmp_path, seed=0, max_steps=3, workers=1)
    assert [log["name"] for log in logs] == list(WORLD_MODEL_NAMES)
    for name in WORLD_MODEL_NAMES:
        model = load_model(str(tmp_path / name))
        assert json.loads((tmp_path / name / "training_log.json").read_text())["steps"] == 3
        out = model(input_ids=torch.tensor([[1, 5, 6]])).logits
        assert out.shape[-1] == len(build_tokenizer())


def test_shipped_world_is_small_and_consistent():
    from cospec.toy.world import WORLD_DIR

    total = sum(f.stat().st_size for f in WORLD_DIR.rglob("*") if f.is_file())
    assert total < 20 * 2**20
    target = load_tokenizer("toy:target")
    for name in WORLD_MODEL_NAMES[1:]:
        check_same_vocabulary(target, load_tokenizer(f"toy:{name}"), name)


def test_bad_input_errors(tmp_path, capsys):
    with pytest.raises(CoSpecError, match="does not exist"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(CoSpecError, match="unknown toy model"):
        load_model("toy:giant")
    with pytest.raises(CoSpecError, match="unknown task family 'poetry'"):
        tasks.generate("poetry", "test", 1, seed=0)
    other = build_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(CoSpecError, match="different vocabulary"):
        check_same_vocabulary(build_tokenizer(), other, "odd")
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--target", str(tmp_path / "nope"), "--prompt", "Q: 1\nA:"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("cospec: error:")]
    assert len(errors) == 1 and "does not exist" in errors[0] and "Traceback" not in err


def test_cli_rejects_mismatched_drafter(tmp_path, capsys):
    tok = build_tokenizer()
    tok.add_tokens(["<extra>"])
    model = load_model("toy:drafter_math")
    model.save_pretrained(tmp_path / "odd")
    tok.save_pretrained(tmp_path / "odd")
    with pytest.raises(SystemExit):
        main(["generate", "--drafter", str(tmp_path / "odd"), "--prompt", "Q: 1\nA:"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("cospec: error:")]
    assert len(errors) == 1 and "different vocabulary" in errors[0]
    assert "Traceback" not in err
