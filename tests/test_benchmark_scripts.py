"""The statistics the benchmark scripts report, against brute force.

``benchmarks/`` holds scripts, not a package: they are imported from their directory, the
way ``python benchmarks/X.py`` runs them.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _shared import run_script
from metasd import (
    MIN_ALIVE,
    Workload,
    best_arm_curve,
    family_be_zero,
    family_mal,
    first_round_reaching,
    parse_args,
)
from viasd import expected_best_of_random

from cospec.errors import CoSpecError


@pytest.mark.parametrize("n", [1, 2, 3])
def test_expected_best_of_random_equals_enumeration(n: int) -> None:
    kls = [0.7, 0.2, 1.5, 0.2, 3.0]
    draws = list(itertools.product(kls, repeat=n))
    brute = sum(min(d) for d in draws) / len(draws)
    assert expected_best_of_random(kls, n) == pytest.approx(brute, rel=1e-12)


@dataclass
class _Round:
    drafter: int
    accepted: int = 0


@dataclass
class _Sequence:
    rounds: list[_Round]


@dataclass
class _Problem:
    family: str


def _run(drafters_per_query: list[list[int]]) -> dict[str, object]:
    return {"sequences": [_Sequence([_Round(d) for d in ds]) for ds in drafters_per_query]}


def test_best_arm_curve_per_round_and_cumulative() -> None:
    # 66 math queries (best arm 0) try arm 1 first, then stay on arm 0: per round 1.0 from
    # round 2, cumulatively exactly 4/5 at round 5 (no float shortfall below 0.8).
    run = _run([[1, 0, 0, 0, 0, 0]] * 66)
    curve = best_arm_curve(run, ["math"] * 66, {"math": 0, "string": 1})
    assert curve["fraction"][:3] == [0.0, 1.0, 1.0]
    assert curve["cumulative"][4] == 0.8
    assert first_round_reaching(curve, 0.8, "cumulative") == 5
    assert first_round_reaching(curve, 0.8) == 2


def test_best_arm_round_needs_enough_queries_alive() -> None:
    short = [[1, 1]] * MIN_ALIVE
    long = [[1, 1, 0]]
    curve = best_arm_curve(_run(short + long), ["math"] * (MIN_ALIVE + 1), {"math": 0})
    assert curve["alive"] == [MIN_ALIVE + 1, MIN_ALIVE + 1, 1]
    assert curve["fraction"][2] == 1.0
    assert first_round_reaching(curve, 0.8) is None


@pytest.mark.parametrize("drafters", [["toy:drafter_math", "/x/drafter_math"], ["/x/oracle"]])
def test_metasd_refuses_ambiguous_drafter_names(drafters: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--json", "out.json", "--drafters", *drafters])


def test_family_statistics_of_fixed_runs() -> None:
    # Two queries per family; per round accepted counts below. MAL = 1 + mean accepted and
    # the BE = 0 share, over each family's rounds only.
    accepted = [[0, 4, 2], [3, 0], [1, 1], [0, 0, 0, 4]]
    run = {"sequences": [_Sequence([_Round(0, a) for a in q]) for q in accepted]}
    problems = [_Problem(f) for f in ("math", "string", "math", "string")]
    workload = Workload([""] * 4, problems, max_new_tokens=8)
    math_rounds, string_rounds = [0, 4, 2, 1, 1], [3, 0, 0, 0, 0, 4]
    assert family_mal([run], workload) == [{
        "math": 1 + sum(math_rounds) / 5, "string": 1 + sum(string_rounds) / 6}]
    assert family_be_zero([run], workload) == [{"math": 1 / 5, "string": 4 / 6}]


@pytest.mark.parametrize("flag", ["--mixed-per-family", "--repeats", "-k"])
def test_metasd_refuses_counts_below_one(flag: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--json", "out.json", flag, "0"])


def test_bad_input_is_one_error_line_and_status_2(capsys) -> None:
    def main() -> None:
        raise CoSpecError("tokenizer path '/nope' does not exist or is not a directory")

    with pytest.raises(SystemExit) as exit_info:
        run_script(main)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("error: tokenizer path '/nope' does not exist "
                                             "or is not a directory")
