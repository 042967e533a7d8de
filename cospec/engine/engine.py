"""The decoding engine: one round is draft -> verify -> accept -> commit.

The same engine serves data generation, RL rollouts and evaluation. ``method`` selects
target-only or drafter-only autoregressive decoding (a round that drafts nothing and emits
one token) or speculative decoding (SPD) with K drafted tokens per round, greedy or
lossless sampling. Rows of a batch accept different numbers of tokens: rejected drafts
become masked holes in a shared column layout (see ``layout.py``), so no cache is ever
rolled back row by row. There is one host synchronisation per round, after acceptance.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from cospec.engine.config import EngineConfig
from cospec.engine.layout import CachedModel, Layout
from cospec.engine.sampling import greedy_accept, sample, speculative_accept, warp_probs
from cospec.engine.trace import (
    TIER_TARGET,
    EngineStats,
    GenerationOutput,
    RoundTrace,
    SequenceResult,
)
from cospec.errors import CoSpecError
from cospec.models import check_same_vocabulary, load_model, load_tokenizer


class Engine:
    """Decodes batches of prompts with a target and (for SPD) a drafter."""

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        drafters: Sequence[PreTrainedModel] = (),
        config: EngineConfig | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        if self.config.method in ("spd", "drafter") and not drafters:
            raise CoSpecError(f"method {self.config.method!r} needs at least one drafter")
        self.target = target
        self.drafters = list(drafters)
        self.tokenizer = tokenizer
        sizes = [m.config.get_text_config().vocab_size for m in [target, *self.drafters]]
        self.vocab_size = min(sizes)
        eos = self.config.eos_token_id
        self.eos_token_id = tokenizer.eos_token_id if eos is None else eos
        self.device = target.device
        self.generator = torch.Generator(device=self.device).manual_seed(self.config.seed)

    @classmethod
    def from_pretrained(
        cls, target: str, drafters: Sequence[str] = (), config: EngineConfig | None = None
    ) -> Engine:
        """Load models and tokenizers by path or Hub id; refuse mismatched vocabularies."""
        config = config or EngineConfig()
        tokenizer = load_tokenizer(target)
        for name in drafters:
            check_same_vocabulary(tokenizer, load_tokenizer(name), name)

        def load(name: str) -> PreTrainedModel:
            return load_model(name, dtype=config.dtype,
                              attn_implementation=config.attn_implementation)

        return cls(load(target), tokenizer, [load(d) for d in drafters], config)

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
            sequences += self._decode_batch(encoded[begin:begin + size], stats)
        stats.seconds["total"] = time.perf_counter() - start
        for prompt, seq in zip(prompts, sequences, strict=True):
            seq.prompt = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        return GenerationOutput(sequences, stats)

    def _decode_batch(self, prompts: list[list[int]], stats: EngineStats) -> list[SequenceResult]:
        cfg = self.config
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        layout = Layout.from_prompts(prompts, pad, self.device)
        if cfg.method == "drafter":
            verifier, drafter = CachedModel(self.drafters[0]), None
        else:
            verifier = CachedModel(self.target)
            drafter = CachedModel(self.drafters[0]) if cfg.drafts else None
        k = cfg.num_draft_tokens if drafter is not None else 0
        models = [verifier] if drafter is None else [verifier, drafter]
        rows = list(range(len(prompts)))
        outputs: list[list[int]] = [[] for _ in prompts]
        traces: list[list[RoundTrace]] = [[] for _ in prompts]
        reasons = ["length"] * len(prompts)
        while rows:
            t0 = time.perf_counter()
            draft, p = self._draft(drafter, layout, k) if drafter is not None else (None, None)
            t1 = time.perf_counter()
            logits = verifier.forward_new(layout, k + 1)[..., : self.vocab_size]
            t2 = time.perf_counter()
            accepted, next_token, q = self._accept(draft, p, logits)
            layout.commit(k, accepted, next_token)
            host = self._round_summary(draft, p, q, accepted, next_token)
            finished = self._record(host, rows, k, outputs, traces, reasons, stats)
            self._count_calls(stats, len(rows), k)
            if finished:
                keep = [i for i in range(len(rows)) if i not in finished]
                rows = [rows[i] for i in keep]
                index = torch.tensor(keep, dtype=torch.long, device=self.device)
                layout.select_rows(index)
                for m in models:
                    m.select_rows(index)
            if rows:
                longest = max(len(prompts[r]) + len(outputs[r]) for r in rows)
                stats.compactions += self._maybe_compact(layout, models, longest)
            t3 = time.perf_counter()
            stats.seconds["draft"] += t1 - t0
            stats.seconds["verify"] += t2 - t1
            stats.seconds["accept"] += t3 - t2
        return [
            SequenceResult("", prompt, out, self.tokenizer.decode(out, skip_special_tokens=True),
                           reason, trace)
            for prompt, out, reason, trace in zip(prompts, outputs, reasons, traces, strict=True)
        ]

    def _count_calls(self, stats: EngineStats, batch: int, k: int) -> None:
        if self.config.method == "drafter":
            stats.drafter_calls[0] = stats.drafter_calls.get(0, 0) + 1
            return
        stats.target_calls += 1
        stats.target_row_forwards += batch
        if k:
            stats.drafter_calls[0] = stats.drafter_calls.get(0, 0) + k

    def _draft(
        self, drafter: CachedModel, layout: Layout, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K autoregressive drafter steps; each appends its token as a tentative column."""
        tokens, probs = [], []
        for _ in range(k):
            logits = drafter.forward_new(layout, 1)[:, -1, : self.vocab_size]
            p = self._probs(logits)
            token = logits.argmax(-1) if self.config.greedy else sample(p, self.generator)
            layout.append(token[:, None])
            tokens.append(token)
            probs.append(p)
        return torch.stack(tokens, 1), torch.stack(probs, 1)

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped distribution under sampling; the plain softmax under greedy (for traces)."""
        cfg = self.config
        if cfg.greedy:
            return logits.float().softmax(-1)
        return warp_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)

    def _accept(
        self, draft: torch.Tensor | None, p: torch.Tensor | None, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self._probs(logits)
        if draft is None:
            draft = logits.new_zeros((logits.shape[0], 0), dtype=torch.long)
            p = q[:, :0]
        if self.config.greedy:
            accepted, next_token = greedy_accept(draft, logits)
        else:
            accepted, next_token = speculative_accept(draft, p, q, self.generator)
        return accepted, next_token, q

    def _round_summary(self, draft, p, q, accepted, next_token) -> list[list[float]]:
        """Everything the trace needs, moved to the host in one transfer."""
        columns = [accepted[:, None].double(), next_token[:, None].double()]
        if draft is not None:
            target_tokens = q.argmax(-1)
            columns += [
                draft.double(),
                p.gather(-1, draft[..., None]).squeeze(-1).double(),
                q[:, :-1].gather(-1, draft[..., None]).squeeze(-1).double(),
                target_tokens.double(),
            ]
        return torch.cat(columns, dim=1).tolist()

    def _record(
        self,
        host: list[list[float]],
        rows: list[int],
        k: int,
        outputs: list[list[int]],
        traces: list[list[RoundTrace]],
        reasons: list[str],
        stats: EngineStats,
    ) -> set[int]:
        """Append each row's new tokens and trace; return the batch indices that finished."""
        finished = set()
        cfg = self.config
        for i, (row, values) in enumerate(zip(rows, host, strict=True)):
            accepted, next_token = int(values[0]), int(values[1])
            draft = [int(t) for t in values[2:2 + k]]
            emitted = [*draft[:accepted], next_token]
            out = outputs[row]
            room = cfg.max_new_tokens - len(out)
            emitted = emitted[:room]
            reason = None
            if self.eos_token_id in emitted:
                emitted = emitted[: emitted.index(self.eos_token_id) + 1]
                reason = "eos"
            start = len(out)
            out.extend(emitted)
            if reason is None and cfg.stop_strings:
                reason = self._check_stop(out, start)
            if reason is None and len(out) >= cfg.max_new_tokens:
                reason = "length"
            if k:
                target_tokens = [int(t) for t in values[2 + 3 * k:]]
                traces[row].append(RoundTrace(
                    drafter=0, draft_tokens=draft, draft_probs=values[2 + k:2 + 2 * k],
                    target_probs=values[2 + 2 * k:2 + 3 * k], target_tokens=target_tokens,
                    accepted=accepted, next_token=next_token,
                    mismatches=[accepted] if accepted < k else [],
                    tiers=[TIER_TARGET] * (len(out) - start),
                ))
                stats.drafted_tokens += k
                stats.accepted_tokens += accepted
                for j in range(accepted):
                    stats.accepted_per_position[j] += 1
            stats.rounds += 1
            stats.emitted_tokens += len(out) - start
            if reason is not None:
                reasons[row] = reason
                finished.add(i)
        return finished

    def _check_stop(self, out: list[int], start: int) -> str | None:
        """Finish at the first emitted token that completes a stop string; drop the rest."""
        longest = max(map(len, self.config.stop_strings))
        for end in range(start + 1, len(out) + 1):
            tail = self.tokenizer.decode(out[max(0, start - longest):end])
            if any(s in tail for s in self.config.stop_strings):
                del out[end:]
                return "stop"
        return None

    def _maybe_compact(self, layout: Layout, models: list[CachedModel], longest: int) -> int:
        """Compact the prefix every model has consumed once holes dominate the layout.

        ``longest`` (the longest row's valid length, known on the host) bounds the holes
        from below without a device synchronisation; the exact plan is computed only when
        compaction happens.
        """
        prefix = min(m.seen for m in models)
        holes = prefix - longest
        if holes < 8 or holes < self.config.compact_threshold * layout.width:
            return 0
        gather = layout.compaction_plan(prefix)
        layout.compact(prefix, gather)
        for m in models:
            m.compact(prefix, gather)
        return 1
