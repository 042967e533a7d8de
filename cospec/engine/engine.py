"""The decoding engine: one round is pick -> draft -> verify -> arbitrate -> commit.

The same engine serves data generation, RL rollouts and evaluation.

- ``method`` selects target-only or drafter-only autoregressive decoding (a round that
  drafts nothing and emits one token) or speculative decoding (SPD) with K drafted tokens
  per round, greedy or lossless sampling.
- With several drafters, a MetaSD bandit picks each row's drafter every round.
- With a slim verifier (VIA-SD), drafted tokens are first settled in tiers 1-2 by the
  layer-skipped target; the full target runs only for rows that reach tier 3.
- With an arbiter (CoSpec), a mismatch between draft and target may keep the draft token.

Rows of a batch accept different numbers of tokens: rejected drafts become masked holes in
a shared column layout (see ``layout.py``), so no cache is rolled back row by row. Plain
SPD takes one host synchronisation per round (after acceptance); VIA-SD adds one to decide
whether the target must run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from cospec.bandit import BanditBatch, block_reward, make_policy
from cospec.engine.config import EngineConfig
from cospec.engine.layout import CachedModel, Layout
from cospec.engine.sampling import (
    greedy_verdicts,
    sample,
    slim_tiers,
    speculative_verdicts,
    walk,
    warp_probs,
)
from cospec.engine.trace import (
    TIER_SLIM_ACCEPT,
    TIER_SLIM_REGENERATE,
    TIER_TARGET,
    EngineStats,
    GenerationOutput,
    RoundTrace,
    SequenceResult,
)
from cospec.errors import CoSpecError
from cospec.models import check_same_vocabulary, load_model, load_tokenizer


@dataclass
class _Verdict:
    """The verifiers' say on one round's block, before arbitration."""

    matches: torch.Tensor  # [B, K] draft token passes verification
    target_tokens: torch.Tensor  # [B, K+1] the verifier's token at each position
    probs: torch.Tensor  # [B, K+1, V] verifier distributions (target, else slim verifier)
    slim_accepted: torch.Tensor  # [B] leading tokens settled in tier 1
    settled: torch.Tensor  # [B] block settled in tiers 1-2 (no target needed)
    target_rows: int  # rows the target verified


@dataclass
class _Batch:
    """Everything one batch carries from round to round."""

    prompts: list[list[int]]
    layout: Layout
    verifier: CachedModel
    drafters: list[CachedModel]
    slim: CachedModel | None
    arbiter: CachedModel | None
    bandit: BanditBatch | None
    rows: list[int]
    outputs: list[list[int]] = field(default_factory=list)
    traces: list[list[RoundTrace]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    last_arms: list[int] = field(default_factory=list)

    @property
    def models(self) -> list[CachedModel]:
        extra = [m for m in (self.slim, self.arbiter) if m is not None]
        return [self.verifier, *self.drafters, *extra]


class Engine:
    """Decodes batches of prompts with a target, drafters and the optional extras."""

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        drafters: Sequence[PreTrainedModel] = (),
        config: EngineConfig | None = None,
        *,
        arbiter=None,
        slim_verifier: PreTrainedModel | None = None,
    ) -> None:
        self.config = cfg = config or EngineConfig()
        self.drafters = list(drafters)
        if arbiter is not None and not self.drafters:
            self.drafters = [arbiter.peft_model.get_base_model()]
        if cfg.method in ("spd", "drafter") and not self.drafters:
            raise CoSpecError(f"method {cfg.method!r} needs at least one drafter")
        if cfg.needs_arbiter_model and arbiter is None:
            raise CoSpecError(f"arbiter_mode {cfg.arbiter_mode!r} needs an arbiter model")
        if arbiter is not None and arbiter.config.num_draft_tokens != cfg.num_draft_tokens:
            raise CoSpecError(
                f"the arbiter was trained for K={arbiter.config.num_draft_tokens}, the engine "
                f"drafts K={cfg.num_draft_tokens}"
            )
        if slim_verifier is not None and cfg.method != "spd":
            raise CoSpecError("a slim verifier needs method 'spd'")
        if cfg.bandit is not None and cfg.method != "spd":
            raise CoSpecError("a drafter bandit needs method 'spd'")
        if cfg.bandit is None and len(self.drafters) > 1 and cfg.method == "spd":
            raise CoSpecError(f"{len(self.drafters)} drafters need a bandit config to choose")
        self.target = target
        self.tokenizer = tokenizer
        self.arbiter = arbiter
        self._arbiter_base = arbiter.peft_model.get_base_model() if arbiter else None
        self.slim_verifier = slim_verifier
        self.policy = make_policy(cfg.bandit, len(self.drafters)) if cfg.bandit else None
        models = [target, *self.drafters]
        self.vocab_size = min(m.config.get_text_config().vocab_size for m in models)
        self.eos_token_id = tokenizer.eos_token_id if cfg.eos_token_id is None else cfg.eos_token_id
        self.device = target.device
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        drafters: Sequence[str] = (),
        config: EngineConfig | None = None,
        *,
        arbiter: str | None = None,
        slim_verifier_mask: str | None = None,
    ) -> Engine:
        """Load models by path or Hub id; refuse drafters with another vocabulary.

        An arbiter is loaded onto the first drafter's weights (it is that drafter plus an
        adapter); a slim verifier is cut from the target by the saved routing mask.
        """
        from cospec.arbiter import ArbiterModel
        from cospec.slim import RoutingMask, build_slim_verifier

        config = config or EngineConfig()
        tokenizer = load_tokenizer(target)
        for name in drafters:
            check_same_vocabulary(tokenizer, load_tokenizer(name), name)

        def load(name: str) -> PreTrainedModel:
            return load_model(name, dtype=config.dtype, device=config.resolved_device,
                              attn_implementation=config.attn_implementation)

        target_model = load(target)
        drafter_models = [load(d) for d in drafters]
        arbiter_model = None
        if arbiter is not None:
            base = drafter_models[0] if drafter_models else None
            arbiter_model = ArbiterModel.load(arbiter, base, dtype=config.dtype,
                                              device=config.resolved_device,
                                              attn_implementation=config.attn_implementation)
        slim = None
        if slim_verifier_mask is not None:
            slim = build_slim_verifier(target_model, RoutingMask.load(slim_verifier_mask))
        return cls(target_model, tokenizer, drafter_models, config, arbiter=arbiter_model,
                   slim_verifier=slim)

    def encode(self, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
        """Token ids of each prompt; empty prompts are refused (nothing to condition on)."""
        if not prompts:
            raise CoSpecError("no prompts given")
        encoded = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if not prompt.strip():
                    raise CoSpecError(f"prompt {i} is empty")
                ids = self.tokenizer(prompt, add_special_tokens=True).input_ids
            else:
                ids = list(prompt)
            if not ids:
                raise CoSpecError(f"prompt {i} is empty")
            encoded.append(ids)
        return encoded

    @torch.inference_mode()
    def generate(self, prompts: Sequence[str | Sequence[int]]) -> GenerationOutput:
        """Decode every prompt; results come back in prompt order."""
        encoded = self.encode(prompts)
        stats = EngineStats(accepted_per_position=[0] * self.config.num_draft_tokens)
        start = time.perf_counter()
        sequences: list[SequenceResult] = []
        size = self.config.batch_size
        for begin in range(0, len(encoded), size):
            batch = self._new_batch(encoded[begin:begin + size], first_row=begin)
            while batch.rows:
                self._round(batch, stats)
            sequences += [
                SequenceResult("", ids, out, self.tokenizer.decode(out, skip_special_tokens=True),
                               reason, trace)
                for ids, out, reason, trace in zip(batch.prompts, batch.outputs, batch.reasons,
                                                   batch.traces, strict=True)
            ]
        stats.seconds["total"] = time.perf_counter() - start
        for prompt, seq in zip(prompts, sequences, strict=True):
            seq.prompt = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        return GenerationOutput(sequences, stats)

    # ---- one batch, one round -----------------------------------------------------------

    def _new_batch(self, prompts: list[list[int]], first_row: int) -> _Batch:
        cfg = self.config
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        n = len(prompts)
        spd = cfg.method == "spd"
        verifier_model = self.drafters[0] if cfg.method == "drafter" else self.target
        arbiter = None
        if self.arbiter is not None and cfg.needs_arbiter_model:
            arbiter = CachedModel(self.arbiter.peft_model.get_base_model())
        bandit = None
        if self.policy is not None:
            bandit = BanditBatch.create(self.policy, n, seed=cfg.bandit.seed,
                                        row_ids=range(first_row, first_row + n))
        return _Batch(
            prompts=prompts,
            layout=Layout.from_prompts(prompts, pad, self.device),
            verifier=CachedModel(verifier_model),
            drafters=[CachedModel(d) for d in self.drafters] if spd else [],
            slim=CachedModel(self.slim_verifier) if self.slim_verifier is not None else None,
            arbiter=arbiter,
            bandit=bandit,
            rows=list(range(n)),
            outputs=[[] for _ in prompts],
            traces=[[] for _ in prompts],
            reasons=["running"] * n,
            last_arms=[-1] * n,
        )

    def _round(self, b: _Batch, stats: EngineStats) -> None:
        """One round for every live row: pick drafters -> draft K -> verify (slim verifier
        tiers, then the target) -> arbitrate mismatches -> walk -> commit -> record."""
        cfg = self.config
        t0 = time.perf_counter()
        if not b.drafters:
            self._autoregressive_round(b, stats)
            stats.seconds["verify"] += time.perf_counter() - t0
            return
        k = cfg.num_draft_tokens
        arms = b.bandit.select() if b.bandit is not None else [0] * len(b.rows)
        draft, p = self._draft(b, arms, k)
        t1 = time.perf_counter()
        verdict = self._verify(b, draft, p)
        t2 = time.perf_counter()
        keep, arbiter_probs = self._arbitrate(b, draft, verdict)
        accepted, next_token = walk(verdict.matches | keep, verdict.target_tokens)
        b.layout.commit(k, accepted, next_token)
        reward = None
        if b.bandit is not None:
            reward = block_reward(cfg.bandit.reward, accepted=accepted,
                                  num_drafted=torch.full_like(accepted, k), draft_probs=p,
                                  target_probs=verdict.probs[:, :k])
        host = _to_host(
            accepted=accepted, next_token=next_token, slim_accepted=verdict.slim_accepted,
            settled=verdict.settled, reward=reward, draft=draft,
            draft_probs=p.gather(-1, draft[..., None]).squeeze(-1),
            target_probs=verdict.probs[:, :k].gather(-1, draft[..., None]).squeeze(-1),
            target_tokens=verdict.target_tokens, matches=verdict.matches,
            arbiter_probs=arbiter_probs, keep=keep,
        )
        if b.bandit is not None:
            b.bandit.update(arms, [row["reward"][0] for row in host])
        finished = []
        for i, (row, values, arm) in enumerate(zip(b.rows, host, arms, strict=True)):
            stats.drafter_switches += int(b.last_arms[row] not in (-1, arm))
            b.last_arms[row] = arm
            if self._record_spd_round(b, row, arm, values, k, stats):
                finished.append(i)
        stats.target_row_forwards += verdict.target_rows
        stats.target_calls += int(verdict.target_rows > 0)
        stats.slim_calls += int(b.slim is not None)
        for arm in set(arms):
            stats.drafter_calls[arm] = stats.drafter_calls.get(arm, 0) + k
        t3 = time.perf_counter()
        self._drop_and_compact(b, finished, stats)
        stats.seconds["draft"] += t1 - t0
        stats.seconds["verify"] += t2 - t1
        stats.seconds["accept"] += t3 - t2
        stats.seconds["commit"] += time.perf_counter() - t3

    def _autoregressive_round(self, b: _Batch, stats: EngineStats) -> None:
        """Target-only or drafter-only: one verifier forward, one token per row."""
        with self._adapter_off(b.verifier.model):
            logits = b.verifier.forward_new(b.layout, 1)[:, -1, : self.vocab_size]
        if self.config.greedy:
            token = logits.argmax(-1)
        else:
            token = sample(self._probs(logits), self.generator)
        b.layout.commit(0, torch.zeros_like(token), token)
        finished = []
        for i, (row, value) in enumerate(zip(b.rows, token.tolist(), strict=True)):
            emitted = self._append(b, row, [value])
            stats.rounds += 1
            stats.emitted_tokens += len(emitted)
            if b.reasons[row] != "running":
                finished.append(i)
        if self.config.method == "drafter":
            stats.drafter_calls[0] = stats.drafter_calls.get(0, 0) + 1
        else:
            stats.target_calls += 1
            stats.target_row_forwards += len(b.rows)
        self._drop_and_compact(b, finished, stats)

    # ---- draft --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _adapter_off(self, model: PreTrainedModel) -> Iterator[None]:
        """The arbiter's adapter lives in its drafter's modules; drafting runs without it."""
        if model is self._arbiter_base:
            with self.arbiter.drafter():
                yield
        else:
            yield

    def _draft(
        self, b: _Batch, arms: list[int], k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K autoregressive steps; each appends one token per row as a tentative column.

        Every drafter chosen by some row runs on the whole batch (one batched call per
        drafter and step) and each row keeps the output of its own drafter; a drafter no
        row chose sits the round out and catches up on the committed tokens later.
        """
        active = sorted(set(arms))
        choice = torch.tensor([active.index(a) for a in arms], device=self.device)
        rows = torch.arange(len(arms), device=self.device)
        tokens, probs = [], []
        for _ in range(k):
            outputs = []
            for arm in active:
                with self._adapter_off(b.drafters[arm].model):
                    outputs.append(b.drafters[arm].forward_new(b.layout, 1)[:, -1])
            logits = outputs[0] if len(active) == 1 else torch.stack(outputs)[choice, rows]
            logits = logits[:, : self.vocab_size]
            p = self._probs(logits)
            token = logits.argmax(-1) if self.config.greedy else sample(p, self.generator)
            b.layout.append(token[:, None])
            tokens.append(token)
            probs.append(p)
        return torch.stack(tokens, 1), torch.stack(probs, 1)

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped distribution under sampling; the plain softmax under greedy (for traces)."""
        cfg = self.config
        if cfg.greedy:
            return logits.float().softmax(-1)
        return warp_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)

    # ---- verify -------------------------------------------------------------------------

    def _target_verdicts(
        self, b: _Batch, draft: torch.Tensor, p: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = b.verifier.forward_new(b.layout, draft.shape[1] + 1)[..., : self.vocab_size]
        q = self._probs(logits)
        if self.config.greedy:
            matches, tokens = greedy_verdicts(draft, logits)
        else:
            matches, tokens = speculative_verdicts(draft, p, q, self.generator)
        return matches, tokens, q

    def _verify(self, b: _Batch, draft: torch.Tensor, p: torch.Tensor) -> _Verdict:
        """Target verification, preceded by the slim verifier's tiers 1-2 under VIA-SD.

        See :func:`slim_tiers` for tiers 1-2; rows that reach tier 3 are verified by the full
        target from their first unsettled position on. The target runs only when some row
        needs it.
        """
        batch, k = draft.shape
        zeros = torch.zeros(batch, dtype=torch.long, device=self.device)
        if b.slim is None:
            matches, tokens, q = self._target_verdicts(b, draft, p)
            return _Verdict(matches, tokens, q, zeros, zeros.bool(), batch)
        cfg = self.config
        slim_logits = b.slim.forward_new(b.layout, k + 1)[..., : self.vocab_size]
        qs = self._probs(slim_logits)
        slim_accepted, settled, slim_tokens = slim_tiers(draft, qs, cfg.alpha_accept,
                                                         cfg.alpha_regen)
        before = torch.arange(k, device=self.device) < slim_accepted[:, None]
        need_target = ~settled
        target_rows = int(need_target.sum())
        if target_rows == 0:
            return _Verdict(before, slim_tokens, qs, slim_accepted, settled, 0)
        matches, tokens, q = self._target_verdicts(b, draft, p)
        tier3 = need_target[:, None]
        return _Verdict(
            matches=torch.where(tier3, before | matches, before),
            target_tokens=torch.where(tier3, tokens, slim_tokens),
            probs=torch.where(tier3[..., None], q, qs),
            slim_accepted=slim_accepted,
            settled=settled,
            target_rows=target_rows,
        )

    # ---- arbitrate ----------------------------------------------------------------------

    def _arbitrate(
        self, b: _Batch, draft: torch.Tensor, verdict: _Verdict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep decisions at target mismatches and the arbiter's P(accept) per position.

        One arbiter forward scores every block position at once; the walk then applies the
        decisions in order. Rows settled by the slim verifier have no target mismatch.
        """
        cfg = self.config
        k = draft.shape[1]
        probs = torch.full(draft.shape, float("nan"), device=self.device)
        if cfg.arbiter_mode in ("off", "always_reject"):
            return torch.zeros_like(verdict.matches), probs
        if cfg.arbiter_mode == "always_accept":
            keep = torch.ones_like(verdict.matches)
        else:
            state, layout = b.arbiter, b.layout
            width = layout.width - k
            logits = self.arbiter.score_round(
                layout.tokens[:, state.seen:width], layout.valid[:, :width].long(),
                layout.positions[:, state.seen:width], state.cache, draft,
                verdict.target_tokens[:, :k],
            )
            state.seen = width
            probs = logits.float().sigmoid()
            if cfg.arbiter_mode == "threshold":
                keep = probs >= cfg.arbiter_threshold
            else:
                keep = torch.bernoulli(probs, generator=self.generator).bool()
        after_tier1 = torch.arange(k, device=self.device) >= verdict.slim_accepted[:, None]
        return keep & ~verdict.matches & ~verdict.settled[:, None] & after_tier1, probs

    # ---- commit -------------------------------------------------------------------------

    def _record_spd_round(
        self, b: _Batch, row: int, arm: int, values: dict[str, list[float]], k: int,
        stats: EngineStats,
    ) -> bool:
        """Append a row's tokens and round trace; True when the row has finished."""
        accepted, next_token = int(values["accepted"][0]), int(values["next_token"][0])
        slim_accepted, settled = int(values["slim_accepted"][0]), bool(values["settled"][0])
        draft = [int(t) for t in values["draft"]]
        matches = [bool(m) for m in values["matches"]]
        keep = [bool(x) for x in values["keep"]]
        emitted = self._append(b, row, [*draft[:accepted], next_token])
        # Positions the walk reached and whose token was emitted: an eos, a stop string or
        # the token budget can end the sequence before the walk does.
        walked = range(min(accepted + 1, k, len(emitted)))
        mismatches = [j for j in walked if not matches[j]]
        tiers = [TIER_SLIM_ACCEPT if j < slim_accepted
                 else TIER_SLIM_REGENERATE if settled else TIER_TARGET
                 for j in range(len(emitted))]
        arbitrated = self.config.arbiter_mode != "off" and not settled
        b.traces[row].append(RoundTrace(
            drafter=arm, draft_tokens=draft, draft_probs=values["draft_probs"],
            target_probs=values["target_probs"],
            target_tokens=[int(t) for t in values["target_tokens"]],
            accepted=accepted, next_token=next_token, mismatches=mismatches, tiers=tiers,
            arbiter_probs=[values["arbiter_probs"][j] for j in mismatches] if arbitrated else [],
            arbiter_decisions=[keep[j] for j in mismatches] if arbitrated else [],
            bandit_reward=values["reward"][0] if b.bandit is not None else None,
        ))
        stats.rounds += 1
        stats.emitted_tokens += len(emitted)
        stats.drafted_tokens += k
        stats.accepted_tokens += accepted
        for j in range(accepted):
            stats.accepted_per_position[j] += 1
        for tier in tiers:
            stats.tokens_per_tier[tier] = stats.tokens_per_tier.get(tier, 0) + 1
        if arbitrated:
            stats.mismatches += len(mismatches)
            stats.arbiter_accepts += sum(keep[j] for j in mismatches)
        return b.reasons[row] != "running"

    def _append(self, b: _Batch, row: int, tokens: list[int]) -> list[int]:
        """Add a row's new tokens within its budget and settle why it stops, if it does."""
        cfg = self.config
        out = b.outputs[row]
        tokens = tokens[: cfg.max_new_tokens - len(out)]
        reason = "running"
        if self.eos_token_id in tokens:
            tokens = tokens[: tokens.index(self.eos_token_id) + 1]
            reason = "eos"
        start = len(out)
        out.extend(tokens)
        if reason == "running" and cfg.stop_strings and self._hit_stop(out, start):
            reason = "stop"
        if reason == "running" and len(out) >= cfg.max_new_tokens:
            reason = "length"
        b.reasons[row] = reason
        return out[start:]

    def _hit_stop(self, out: list[int], start: int) -> bool:
        """Cut the output after the first token that completes a stop string."""
        longest = max(map(len, self.config.stop_strings))
        for end in range(start + 1, len(out) + 1):
            tail = self.tokenizer.decode(out[max(0, start - longest):end])
            if any(s in tail for s in self.config.stop_strings):
                del out[end:]
                return True
        return False

    def _drop_and_compact(self, b: _Batch, finished: list[int], stats: EngineStats) -> None:
        """Drop finished rows from every cache; compact once holes dominate the layout.

        The holes of the prefix every model has consumed are bounded from below by the
        longest row's valid length (known on the host), so deciding costs no device sync.
        """
        if finished:
            keep = [i for i in range(len(b.rows)) if i not in set(finished)]
            b.rows = [b.rows[i] for i in keep]
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            b.layout.select_rows(index)
            for m in b.models:
                m.select_rows(index)
            if b.bandit is not None:
                b.bandit.select_rows(keep)
        if not b.rows:
            return
        prefix = min(m.seen for m in b.models)
        longest = max(len(b.prompts[r]) + len(b.outputs[r]) for r in b.rows)
        holes = prefix - longest
        if holes < 8 or holes < self.config.compact_threshold * b.layout.width:
            return
        gather = b.layout.compaction_plan(prefix)
        b.layout.compact(prefix, gather)
        for m in b.models:
            m.compact(prefix, gather)
        stats.compactions += 1


def _to_host(**columns: torch.Tensor | None) -> list[dict[str, list[float]]]:
    """Move every per-row tensor to the host in one transfer; split back by name."""
    names, parts = [], []
    for name, tensor in columns.items():
        if tensor is None:
            continue
        part = tensor.reshape(tensor.shape[0], -1).double()
        names.append((name, part.shape[1]))
        parts.append(part)
    rows = torch.cat(parts, dim=1).tolist()
    out = []
    for values in rows:
        record, offset = {}, 0
        for name, width in names:
            record[name] = values[offset:offset + width]
            offset += width
        out.append(record)
    return out
