"""``cospec generate`` with every engine feature switched on from the command line."""

from __future__ import annotations

import json

import torch

from cospec.arbiter import ArbiterModel
from cospec.cli import main
from cospec.engine.trace import TIER_TARGET
from cospec.models import load_model
from cospec.slim import RoutingMask

MATH = "Q: Ann has 15 pens. She gives away 7. How many pens are left?\nA:"
STRING = "Q: Reverse the word kvoa.\nA:"


def test_generate_json_with_bandit_arbiter_and_slim_verifier(tmp_path, capsys):
    torch.manual_seed(0)
    ArbiterModel.from_drafter(load_model("toy:drafter_math"), num_draft_tokens=4,
                              base_model="toy:drafter_math").save_pretrained(tmp_path / "arb")
    RoutingMask([False, False, False, False], [False, True, False, False]).save(
        tmp_path / "mask.json")
    main(["generate", "--drafter", "toy:drafter_math", "--drafter", "toy:drafter_string",
          "--arbiter", str(tmp_path / "arb"), "--slim-verifier-mask", str(tmp_path / "mask.json"),
          "--prompt", MATH, "--prompt", STRING, "--max-new-tokens", "40", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    sequences, stats = out["sequences"], out["stats"]
    assert [s["prompt"] for s in sequences] == [MATH, STRING]
    assert all(s["text"] and s["finish_reason"] == "eos" for s in sequences)
    assert {r["drafter"] for s in sequences for r in s["rounds"]} <= {0, 1}
    assert stats["slim_calls"] > 0 and stats["target_calls"] <= stats["slim_calls"]
    assert sum(stats["tokens_per_tier"].values()) == stats["emitted_tokens"]
    arbitrated = [r for s in sequences for r in s["rounds"] if r["arbiter_decisions"]]
    assert all(r["tiers"][-1] == TIER_TARGET for r in arbitrated)


def test_generate_plain_text_shows_the_stats_line(capsys):
    main(["generate", "--method", "target", "--prompt", MATH, "--no-color"])
    out = capsys.readouterr().out
    assert out.startswith(MATH) and "[target]" in out and "target forwards/token 1.000" in out
