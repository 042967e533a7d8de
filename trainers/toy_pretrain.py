"""Recipe: pretrain the toy world's base models (target and drafters) from scratch.

Reads top to bottom: build tokenizer -> draw the training mixture -> train with AdamW and
a warm-up/cosine schedule, loss on answer tokens only -> save model, tokenizer and the
loss curve. Everything is seeded, so ``cospec toy build`` reproduces the shipped world.
Tiny models are dominated by Python overhead on CPU, so each model trains in its own
process with one torch thread and the two cores train two models at once.
"""

from __future__ import annotations

import json
import math
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LlamaForCausalLM
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from cospec.toy import tasks
from cospec.toy.tokenizer import build_tokenizer
from cospec.toy.world import SPECS, WORLD_MODEL_NAMES, ToyModelSpec, toy_model_path

IGNORE_INDEX = -100


def training_examples(spec: ToyModelSpec, n: int, seed: int) -> list[tasks.Problem]:
    """Draw ``n`` training problems following the spec's family and kind mixture."""
    rng = random.Random(seed)
    families = list(spec.family_weights)
    picks = rng.choices(families, weights=[spec.family_weights[f] for f in families], k=n)
    counts = {f: picks.count(f) for f in families}
    pools = {
        f: tasks.generate(f, "train", counts[f], seed, spec.kind_weights.get(f))
        for f in families
    }
    examples = [pools[f].pop() for f in picks]
    return examples


def encode_batch(
    tokenizer: PreTrainedTokenizerBase, problems: list[tasks.Problem]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels that score only the answer tokens."""
    prompts = tokenizer([p.prompt for p in problems], add_special_tokens=True).input_ids
    answers = tokenizer([p.solution for p in problems], add_special_tokens=False).input_ids
    rows = [q + a + [tokenizer.eos_token_id] for q, a in zip(prompts, answers, strict=True)]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        labels[i, len(prompt) : len(row)] = ids[i, len(prompt) : len(row)]
    return ids, mask, labels


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak learning rate."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train_toy_model(
    spec: ToyModelSpec, out_dir: Path, seed: int = 0, progress_position: int = 0
) -> dict[str, object]:
    """Train one toy model and save it (with tokenizer and loss curve) under ``out_dir``."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    config = spec.config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
                         tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec.learning_rate, betas=(0.9, 0.98), weight_decay=0.01
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, spec.warmup_steps, spec.max_steps)
    )
    examples = training_examples(spec, spec.max_steps * spec.batch_size, seed)
    losses: list[float] = []
    start = time.perf_counter()
    model.train()
    bar = tqdm(range(spec.max_steps), desc=spec.name, position=progress_position, leave=True)
    for step in bar:
        batch = examples[step * spec.batch_size : (step + 1) * spec.batch_size]
        ids, mask, labels = encode_batch(tokenizer, batch)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    seconds = time.perf_counter() - start
    out = toy_model_path(spec.name, out_dir)
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log = {"name": spec.name, "steps": spec.max_steps, "seed": seed, "seconds": seconds,
           "final_loss": sum(losses[-50:]) / len(losses[-50:]), "loss_every_50": losses[::50]}
    (out / "training_log.json").write_text(json.dumps(log, indent=1))
    return log


def build_world(
    out_dir: Path, seed: int = 0, max_steps: int | None = None, workers: int = 2
) -> list[dict[str, object]]:
    """Train every toy model into ``out_dir``; ``max_steps`` overrides the budgets (tests)."""
    specs = [SPECS[n] if max_steps is None else replace(SPECS[n], max_steps=max_steps,
                                                         warmup_steps=min(5, max_steps))
             for n in WORLD_MODEL_NAMES]
    out_dir.mkdir(parents=True, exist_ok=True)
    if workers <= 1:
        return [train_toy_model(s, out_dir, seed) for s in specs]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(train_toy_model, s, out_dir, seed, i % workers)
                   for i, s in enumerate(specs)]
        return [f.result() for f in futures]
