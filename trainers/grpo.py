"""Recipe: stage 2, GRPO on full collaborative (CoSpec) rollouts.

Reads top to bottom: load target, the stage-1 arbiter (trainable) and its frozen copy as
the reference adapter -> each step, every process rolls out its own prompts G times with
the engine, the arbiter *sampling* its decisions -> shaped rewards and group advantages
(``grpo_objective.py``) -> ``num_iterations`` passes of the clipped decision loss over
one packed forward per rollout -> log, checkpoint, repeat. Field names follow TRL's
GRPOConfig where the meaning is the same.

    accelerate launch -m trainers.grpo --config configs/grpo/toy.yaml
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed
from safetensors.torch import load_file
from tqdm.auto import tqdm

from cospec.arbiter import ArbiterModel, ArbitratedRound, pack_rollouts
from cospec.arbiter.model import HEAD_FILE, ArbiterConfig
from cospec.engine import Engine, EngineConfig, SequenceResult
from cospec.errors import CoSpecError
from cospec.models import check_same_vocabulary, load_model, load_tokenizer
from cospec.toy import tasks
from data_gen.tasks import load_task_items, task_stop_strings
from trainers.checkpointing import (
    TrainerState,
    checkpoint_trainable_only,
    list_checkpoints,
    load_checkpoint,
    save_arbiter,
    save_checkpoint,
)
from trainers.distributed import (
    build_accelerator,
    gathered_for_decoding,
    loading_whole,
    replicas_in_sync,
)
from trainers.grpo_objective import (
    LOSS_TYPES,
    SCALE_REWARDS,
    RewardWeights,
    bernoulli_log_prob,
    clipped_surrogate_loss,
    group_advantages,
    shaped_reward,
    summarise_rollout,
)
from trainers.metrics import MetricsLog
from trainers.sft import PackedScorer

REFERENCE_ADAPTER = "reference"
ENGINE_FIELDS_SET_HERE = {"method", "num_draft_tokens", "max_new_tokens", "temperature",
                          "arbiter_mode", "batch_size", "stop_strings", "seed"}


@dataclass
class GRPOConfig:
    """Stage-2 settings; TRL GRPOConfig names where the meaning matches."""

    target: str = field(default="toy:target", metadata={"help": "target model path or id"})
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "sdpa or eager"})
    sft_arbiter: str = field(
        default="runs/toy/sft/arbiter",
        metadata={"help": "stage-1 arbiter directory: the starting and reference policy"},
    )
    task: str = field(
        default="math",
        metadata={"help": "toy family (math, string) or benchmark format (gsm8k, math500, "
                          "humaneval, mbpp) of the training prompts"},
    )
    task_source: str | None = field(
        default=None, metadata={"help": "training JSONL path or Hub id for benchmark tasks"}
    )
    num_train_prompts: int = field(default=512, metadata={"help": "size of the prompt pool"})
    stop_strings: list[str] = field(
        default_factory=list, metadata={"help": "extra stop strings for rollouts"}
    )
    prompts_per_step: int = field(
        default=8, metadata={"help": "prompts per process per step (each rolled out G times)"}
    )
    num_generations: int = field(default=8, metadata={"help": "G: rollouts per prompt"})
    num_draft_tokens: int = field(default=4, metadata={"help": "K"})
    max_completion_length: int = field(default=64, metadata={"help": "new tokens per rollout"})
    temperature: float = field(
        default=0.0, metadata={"help": "token sampling temperature (decisions always sampled)"}
    )
    engine: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "extra EngineConfig fields for rollouts (bandit, alpha_accept, ...)"},
    )
    learning_rate: float = field(default=5e-5, metadata={"help": "AdamW learning rate"})
    max_steps: int = field(default=20, metadata={"help": "optimisation steps"})
    num_iterations: int = field(
        default=1, metadata={"help": "passes over each rollout batch (mu in GRPO)"}
    )
    epsilon: float = field(default=0.2, metadata={"help": "lower clip of the ratio"})
    epsilon_high: float = field(default=0.28, metadata={"help": "upper clip of the ratio"})
    beta: float = field(default=0.04, metadata={"help": "weight of the KL to stage 1"})
    scale_rewards: str = field(default="group", metadata={"help": "group, batch or none"})
    loss_type: str = field(default="grpo", metadata={"help": "grpo or dapo aggregation"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping"})
    report_to: str = field(default="none", metadata={"help": "none, tensorboard or wandb"})
    lambda_span: float = field(default=0.5, metadata={"help": "reward per collaborative share"})
    lambda_risk: float = field(default=0.5, metadata={"help": "penalty for risky accepts"})
    lambda_fallback: float = field(default=0.25, metadata={"help": "penalty for fallbacks"})
    tau_risk: float = field(default=0.05, metadata={"help": "target prob below = risky"})
    seed: int = field(default=0, metadata={"help": "seed of prompts, rollouts and init"})
    output_dir: str = field(default="runs/toy/grpo", metadata={"help": "where to write"})
    logging_steps: int = field(default=1, metadata={"help": "log every N steps"})
    save_steps: int = field(default=10, metadata={"help": "checkpoint every N steps"})
    save_total_limit: int | None = field(
        default=2, metadata={"help": "keep the newest N checkpoints (None: all)"}
    )
    resume_from_checkpoint: bool = field(
        default=True, metadata={"help": "continue from the latest checkpoint in output_dir"}
    )

    def __post_init__(self) -> None:
        if self.scale_rewards not in SCALE_REWARDS:
            raise CoSpecError(f"scale_rewards must be one of {SCALE_REWARDS}")
        if self.loss_type not in LOSS_TYPES:
            raise CoSpecError(f"loss_type must be one of {LOSS_TYPES}")
        if self.num_generations < 2:
            raise CoSpecError("num_generations must be >= 2 (advantages compare a group)")
        if self.task not in tasks.FAMILIES and not self.task_source:
            raise CoSpecError(f"task {self.task!r} needs task_source (a training JSONL path)")
        clash = set(self.engine) & ENGINE_FIELDS_SET_HERE
        if clash:
            raise CoSpecError(f"engine settings {sorted(clash)} are set by GRPO itself; use "
                              "the GRPO fields instead")
        for name in ("prompts_per_step", "max_steps", "num_iterations", "num_train_prompts"):
            if getattr(self, name) < 1:
                raise CoSpecError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def reward_weights(self) -> RewardWeights:
        return RewardWeights(self.lambda_span, self.lambda_risk, self.lambda_fallback,
                             self.tau_risk)


@dataclass
class Rollout:
    """One trajectory: what the loss needs, flattened from the engine's trace."""

    sequence: torch.Tensor
    rounds: list[ArbitratedRound]
    decisions: list[tuple[int, int, bool, float]]  # (round index, position, keep, P(accept))
    reward: float
    correct: bool
    collaborative_share: float


def to_rollout(seq: SequenceResult, correct: bool, config: GRPOConfig) -> Rollout:
    """Arbitrated rounds with their context lengths and decisions, from the trace."""
    k = config.num_draft_tokens
    context = len(seq.prompt_ids)
    rounds: list[ArbitratedRound] = []
    decisions: list[tuple[int, int, bool, float]] = []
    for r in seq.rounds:
        if r.arbiter_decisions:
            for j, keep, prob in zip(r.mismatches, r.arbiter_decisions, r.arbiter_probs,
                                     strict=True):
                decisions.append((len(rounds), j, keep, prob))
            rounds.append(ArbitratedRound(context, torch.tensor(r.draft_tokens),
                                          torch.tensor(r.target_tokens[:k])))
        context += r.accepted + 1
    summary = summarise_rollout(seq.rounds, len(seq.token_ids), correct, config.tau_risk)
    return Rollout(
        sequence=torch.tensor(seq.prompt_ids + seq.token_ids),
        rounds=rounds,
        decisions=decisions,
        reward=shaped_reward(summary, config.reward_weights),
        correct=correct,
        collaborative_share=summary.collaborative_tokens / max(1, summary.emitted),
    )


def decision_loss(
    model: torch.nn.Module,
    arbiter: ArbiterModel,
    rollouts: list[Rollout],
    advantages: list[float],
    config: GRPOConfig,
    reference_head: torch.nn.Linear | None,
    pad_token_id: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate over every decision of ``rollouts``: one packed policy forward
    (and the reference's when ``beta`` > 0).

    A process without any decision still runs the same forwards (the policy's, and the
    reference's when ``beta`` > 0) and a zero-weight backward over a dummy round: it joins
    the gradient all-reduce, and under ZeRO-3 every parameter gather, like every other
    process.
    """
    k = config.num_draft_tokens
    has_decisions = any(r.decisions for r in rollouts)
    packed_inputs = [(r.sequence, r.rounds) for r in rollouts if r.rounds]
    if not has_decisions:
        seq = rollouts[0].sequence
        packed_inputs = [(seq, [ArbitratedRound(len(seq), seq[:k], seq[:k])])]
    batch = pack_rollouts(packed_inputs, k, pad_token_id).to(arbiter.device)
    logits = model(batch.input_ids, batch.position_ids, batch.mask, batch.round_mask)
    reference = None
    if config.beta > 0 and reference_head is not None:
        with torch.no_grad(), arbiter.reference_policy(REFERENCE_ADAPTER, reference_head):
            reference = arbiter.score_packed_batch(batch)
    if not has_decisions:
        return logits.sum() * 0.0, {"clip_fraction": 0.0, "kl": 0.0, "entropy": 0.0}
    rows, round_index, positions, keeps, old, adv, owner = [], [], [], [], [], [], []
    row = 0
    for index, (rollout, advantage) in enumerate(zip(rollouts, advantages, strict=True)):
        if not rollout.rounds:
            continue
        for n, j, keep, prob in rollout.decisions:
            rows.append(row)
            round_index.append(n)
            positions.append(j)
            keeps.append(keep)
            old.append(prob)
            adv.append(advantage)
            owner.append(index)
        row += 1
    device = arbiter.device
    select = (torch.tensor(rows, device=device), torch.tensor(round_index, device=device),
              torch.tensor(positions, device=device))
    chosen = logits[select]
    decisions = torch.tensor(keeps, device=device)
    old_probs = torch.tensor(old, device=device).clamp(1e-6, 1 - 1e-6)
    old_log_probs = bernoulli_log_prob(torch.logit(old_probs), decisions)
    reference_logits = reference[select] if reference is not None else None
    return clipped_surrogate_loss(
        chosen, decisions, old_log_probs, torch.tensor(adv, device=device),
        torch.tensor(owner, device=device), len(rollouts), config.epsilon,
        config.epsilon_high, config.beta, reference_logits, config.loss_type,
    )


def main(argv: list[str] | None = None) -> None:
    from trl import TrlParser

    (config,) = TrlParser((GRPOConfig,), prog="cospec grpo").parse_args_and_config(argv)
    train(config)


def train(config: GRPOConfig) -> dict[str, float]:
    accelerator = build_accelerator(
        per_device_train_batch_size=config.prompts_per_step * config.num_generations,
        gradient_accumulation_steps=1, max_grad_norm=config.max_grad_norm,
        report_to=config.report_to, project_dir=config.output_dir,
    )
    set_seed(config.seed)
    output_dir = Path(config.output_dir)
    sft_dir = Path(config.sft_arbiter)
    if not (sft_dir / HEAD_FILE).is_file():
        raise CoSpecError(f"stage-1 arbiter {config.sft_arbiter!r} not found (run SFT first)")

    # ---- models: target, trainable arbiter, frozen stage-1 reference ---------------------
    tokenizer = load_tokenizer(config.target)
    check_same_vocabulary(tokenizer, load_tokenizer(ArbiterConfig.load(sft_dir).base_model),
                          "the arbiter's drafter")
    with loading_whole(accelerator):
        target = load_model(config.target, dtype=config.dtype, device=accelerator.device,
                            attn_implementation=config.attn_implementation)
    # Eval mode throughout: LoRA dropout off, so the ratio pi / pi_old compares the same
    # function the rollouts sampled from. Gradients flow regardless of the mode.
    arbiter = ArbiterModel.load(sft_dir, trainable=True, dtype=config.dtype,
                                device=accelerator.device,
                                attn_implementation=config.attn_implementation)
    reference_head = None
    if config.beta > 0:
        arbiter.peft_model.load_adapter(str(sft_dir), adapter_name=REFERENCE_ADAPTER,
                                        is_trainable=False)
        reference_head = torch.nn.Linear(arbiter.head.in_features, 1).to(accelerator.device)
        reference_head.load_state_dict(load_file(sft_dir / HEAD_FILE))
        reference_head.requires_grad_(False)
    trainable = [p for p in arbiter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate)
    model, optimizer = accelerator.prepare(PackedScorer(arbiter).eval(), optimizer)
    checkpoint_trainable_only(accelerator)
    state = TrainerState(
        global_step=0,
        examples_per_step=config.prompts_per_step * config.num_generations
        * accelerator.num_processes,
        train_fingerprint=f"{config.task}:{config.task_source}:{config.seed}:"
                          f"{config.num_train_prompts}",
    )
    checkpoints = list_checkpoints(output_dir) if config.resume_from_checkpoint else []
    if checkpoints:
        resumed = load_checkpoint(accelerator, checkpoints[-1])
        if (resumed.examples_per_step, resumed.train_fingerprint) != (
                state.examples_per_step, state.train_fingerprint):
            raise CoSpecError(f"{checkpoints[-1]} was written with other prompts or batch "
                              "sizes; use a new output_dir")
        state = resumed
    start_step = state.global_step
    if config.report_to != "none":
        accelerator.init_trackers("cospec-grpo", config=dataclasses.asdict(config))
    pad = tokenizer.pad_token_id or 0

    # ---- data: a fixed prompt pool; each step's prompts depend only on (seed, step, rank) -
    pool = load_task_items(config.task, config.task_source, "train", config.num_train_prompts,
                           config.seed)
    stop_strings = task_stop_strings(config.task, config.stop_strings)
    metrics = MetricsLog(output_dir, accelerator, resume_step=start_step)
    last: dict[str, float] = {}
    bar = tqdm(range(start_step, config.max_steps), desc="grpo",
               disable=not accelerator.is_main_process, initial=start_step,
               total=config.max_steps)
    for step in bar:
        rng = random.Random(f"{config.seed}:{step}:{accelerator.process_index}")
        prompts = rng.sample(pool, config.prompts_per_step)
        engine_config = EngineConfig(
            method="spd", num_draft_tokens=config.num_draft_tokens,
            max_new_tokens=config.max_completion_length, temperature=config.temperature,
            arbiter_mode="sample", batch_size=config.prompts_per_step * config.num_generations,
            stop_strings=stop_strings,
            seed=config.seed * 1_000_003 + step * 101 + accelerator.process_index,
            **config.engine,
        )
        engine = Engine(target, tokenizer, [], engine_config, arbiter=arbiter)
        started = time.perf_counter()
        with gathered_for_decoding(model, accelerator):
            out = engine.generate([p.prompt for p in prompts
                                   for _ in range(config.num_generations)])
        rollout_seconds = time.perf_counter() - started
        rollouts = [
            to_rollout(seq, prompts[i // config.num_generations].grade(seq.text), config)
            for i, seq in enumerate(out.sequences)
        ]
        rewards = torch.tensor([r.reward for r in rollouts]).view(-1, config.num_generations)
        correct = torch.tensor([r.correct for r in rollouts]).view(-1, config.num_generations)
        if config.scale_rewards == "batch":
            all_rewards = accelerator.gather(rewards.to(accelerator.device)).cpu()
            std = all_rewards.std()
            advantages = group_advantages(rewards, correct, "none") / (std + 1e-6)
        else:
            advantages = group_advantages(rewards, correct, config.scale_rewards)

        for _ in range(config.num_iterations):
            loss, loss_metrics = decision_loss(model, arbiter, rollouts,
                                               advantages.flatten().tolist(), config,
                                               reference_head, pad)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(trainable, config.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        stats = out.stats
        local = torch.tensor([
            rewards.mean().item(), correct.float().mean().item(),
            sum(r.collaborative_share for r in rollouts) / len(rollouts),
            stats.arbiter_accept_rate if stats.arbiter_accept_rate is not None else math.nan,
            loss_metrics["kl"], loss_metrics["clip_fraction"], loss_metrics["entropy"],
            stats.mean_accepted_length, stats.emitted_tokens / rollout_seconds, loss.item(),
            rewards.std().item(),
        ], device=accelerator.device)
        mean = accelerator.gather(local[None]).nanmean(0).tolist()
        names = ["reward_mean", "accuracy", "rho", "accept_rate", "kl", "clip_fraction",
                 "entropy", "mean_accepted_length", "rollout_tokens_per_s", "loss",
                 "reward_std"]
        values = dict(zip(names, mean, strict=True))
        last = values | {"step": step + 1}
        if (step + 1) % config.logging_steps == 0:
            metrics.log("train", step + 1, values)
            bar.set_postfix(reward=f"{last['reward_mean']:.3f}", acc=f"{last['accuracy']:.2f}")
        if (step + 1) % config.save_steps == 0 or step + 1 == config.max_steps:
            state.global_step = step + 1
            save_checkpoint(accelerator, output_dir, state, config.save_total_limit)

    accelerator.wait_for_everyone()
    in_sync = replicas_in_sync(accelerator, model)
    save_arbiter(accelerator, arbiter, output_dir / "arbiter")
    if accelerator.is_main_process:
        (output_dir / "replicas.json").write_text(json.dumps(
            {"processes": accelerator.num_processes, "replicas_in_sync": in_sync}))
        plot_rewards(metrics.records, output_dir / "reward_curve.png")
    accelerator.end_training()
    return last


def plot_rewards(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["reward_mean"] for r in rows], label="reward")
    ax.plot([r["step"] for r in rows], [r["accuracy"] for r in rows], label="accuracy")
    ax.set_xlabel("step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


if __name__ == "__main__":
    main()
