"""Recipe, stage 1: supervised warm-up of the CoSpec arbiter on judged mismatches.

Reads top to bottom: parse the config -> build the Accelerator -> load the rollouts of
stage 0 and split off the held-out ones -> build the arbiter (LoRA on the drafter + head)
-> AdamW with warm-up and a cosine/linear schedule -> train (one example = one rollout,
all its judged rounds packed into one forward; weighted BCE at each mismatch, normalised by
the weight of the global batch) -> evaluate held-out AUC / accuracy / calibration / BCE
-> save the arbiter, optionally push it to the Hub.

Launch::

    python -m trainers.sft --config configs/sft/toy.yaml
    accelerate launch --config_file configs/accelerate/zero2.yaml -m trainers.sft \\
        --config configs/sft/toy.yaml

Any config key can be overridden on the command line (``--learning_rate 1e-4``). The
config is :class:`SFTConfig` (this stage's fields; not ``trl.SFTConfig``, which trains a
language model) plus TRL's ``ModelConfig`` for the drafter and the LoRA adapter.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from accelerate.utils import set_seed
from datasets import Dataset
from torch import nn
from transformers import get_scheduler
from trl import ModelConfig, TrlParser, get_peft_config

from cospec.arbiter import ArbiterModel, PackedBatch, push_to_hub
from cospec.arbiter.model import DEFAULT_TARGET_MODULES
from cospec.errors import CoSpecError
from cospec.models import load_model
from trainers.checkpointing import (
    TrainerState,
    checkpoint_trainable_only,
    load_checkpoint,
    resolve_resume_checkpoint,
    save_arbiter,
    save_checkpoint,
)
from trainers.distributed import (
    BatchOrder,
    build_accelerator,
    eval_batches,
    gather_lists,
    replicas_in_sync,
)
from trainers.losses import mismatch_logits, weighted_bce_sum
from trainers.metrics import MetricsLog, binary_metrics
from trainers.mismatch_data import (
    collate_rollouts,
    infer_num_draft_tokens,
    load_rollouts,
    split_rollouts,
)

ARBITER_DIR = "arbiter"
SUMMARY_FILE = "training_summary.json"


@dataclass
class SFTConfig:
    """Stage 1 settings. Names follow TRL / transformers ``TrainingArguments`` where they mean
    the same thing; the drafter and LoRA settings come from TRL's ``ModelConfig``."""

    # ---- data ----
    dataset_path: str | None = field(
        default=None, metadata={"help": "Stage 0's output directory (judged SPD rollouts)."}
    )
    eval_fraction: float = field(
        default=0.1, metadata={"help": "Share of rollouts held out, by a hash of rollout_id."}
    )
    eval_split_seed: int = field(
        default=0, metadata={"help": "Seed of the held-out hash (independent of `seed`)."}
    )
    # ---- arbiter ----
    num_draft_tokens: int | None = field(
        default=None, metadata={"help": "K; read from the data when unset (must match it)."}
    )
    head_layout: str = field(
        default="concat", metadata={"help": "How the head combines d_j and t_j: concat or sum."}
    )
    # ---- optimisation ----
    learning_rate: float = field(default=1e-4, metadata={"help": "Peak AdamW learning rate."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Gradient clipping norm (0 disables)."}
    )
    lr_scheduler_type: str = field(
        default="cosine",
        metadata={"help": "transformers scheduler name: cosine, linear, constant_with_warmup."},
    )
    warmup_steps: float = field(
        default=0.05,
        metadata={"help": "Linear warm-up: optimizer steps, or a fraction of all steps if < 1."},
    )
    per_device_train_batch_size: int = field(
        default=8, metadata={"help": "Rollouts per micro-batch per process."}
    )
    per_device_eval_batch_size: int = field(
        default=8, metadata={"help": "Rollouts per held-out batch per process."}
    )
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Micro-batches per optimizer step."}
    )
    num_train_epochs: float = field(
        default=1.0, metadata={"help": "Epochs over the training rollouts (if max_steps <= 0)."}
    )
    max_steps: int = field(
        default=-1, metadata={"help": "Optimizer steps; overrides num_train_epochs when > 0."}
    )
    activation_checkpointing: bool = field(
        default=False, metadata={"help": "Recompute activations in backward (saves memory)."}
    )
    seed: int = field(default=42, metadata={"help": "Seed of initialisation and data order."})
    # ---- logging, evaluation, checkpoints ----
    output_dir: str = field(
        default="runs/sft", metadata={"help": "Where checkpoints, metrics and the arbiter go."}
    )
    logging_steps: int = field(
        default=10, metadata={"help": "Log the training loss every this many optimizer steps."}
    )
    eval_steps: int | None = field(
        default=None, metadata={"help": "Evaluate held-out every this many steps (and at the end)."}
    )
    save_steps: int | None = field(
        default=500, metadata={"help": "Checkpoint every this many optimizer steps."}
    )
    save_total_limit: int | None = field(
        default=None, metadata={"help": "Keep only the newest this many checkpoints."}
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={"help": "Checkpoint directory, or true for the latest one in output_dir."},
    )
    report_to: str = field(
        default="none", metadata={"help": "Tracker: none, tensorboard or wandb."}
    )
    # ---- Hub ----
    push_to_hub: bool = field(
        default=False, metadata={"help": "Push the final arbiter to hub_model_id."}
    )
    hub_model_id: str | None = field(
        default=None, metadata={"help": "Hub repository (user/name) for push_to_hub."}
    )
    hub_private_repo: bool = field(
        default=True, metadata={"help": "Create the Hub repository as private."}
    )

    def __post_init__(self) -> None:
        if self.dataset_path is None:
            raise CoSpecError("dataset_path is required: stage 0's output directory")
        if not 0 <= self.eval_fraction < 1:
            raise CoSpecError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.push_to_hub and not self.hub_model_id:
            raise CoSpecError("push_to_hub needs hub_model_id (user/name)")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise CoSpecError("set max_steps > 0 or num_train_epochs > 0")


class PackedScorer(nn.Module):
    """The arbiter's training forward as a module call, so DDP and DeepSpeed can wrap it."""

    def __init__(self, arbiter: ArbiterModel) -> None:
        super().__init__()
        self.arbiter = arbiter

    @property
    def config(self):
        """The base model's config (DeepSpeed sizes its ``auto`` buckets from hidden_size)."""
        return self.arbiter.peft_model.get_base_model().config

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
        round_mask: torch.Tensor,
    ) -> torch.Tensor:
        return self.arbiter.score_packed_batch(
            PackedBatch(input_ids, position_ids, mask, round_mask)
        )


def main(argv: Sequence[str] | None = None) -> dict[str, float] | None:
    """Entry point: ``python -m trainers.sft --config FILE [--key value ...]``."""
    parser = TrlParser((SFTConfig, ModelConfig))
    config, model_config = parser.parse_args_and_config(
        list(sys.argv[1:] if argv is None else argv)
    )
    return train(config, model_config)


def train(
    config: SFTConfig,
    model_config: ModelConfig,
    *,
    dataset: Dataset | None = None,
    stop_after_step: int | None = None,
) -> dict[str, float] | None:
    """Run stage 1; return the final held-out metrics.

    ``dataset`` replaces loading ``config.dataset_path``. ``stop_after_step`` ends the run
    abruptly after that optimizer step (and its checkpoint, if one is due), as a kill
    would: nothing else is saved and None is returned. Tests use it to check resumption.
    """
    output_dir = Path(config.output_dir)
    accelerator = build_accelerator(
        per_device_train_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        max_grad_norm=config.max_grad_norm,
        report_to=config.report_to,
        project_dir=str(output_dir),
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    resume_path = resolve_resume_checkpoint(output_dir, config.resume_from_checkpoint)

    # ---- data ----------------------------------------------------------------------------
    dataset = load_rollouts(config.dataset_path) if dataset is None else dataset
    train_ids, eval_ids = split_rollouts(dataset, config.eval_fraction, config.eval_split_seed)
    k = infer_num_draft_tokens(dataset, train_ids)
    if config.num_draft_tokens is not None and config.num_draft_tokens != k:
        raise CoSpecError(f"num_draft_tokens={config.num_draft_tokens}, but the data has K={k}")
    order = BatchOrder(
        len(train_ids), config.per_device_train_batch_size, world,
        config.gradient_accumulation_steps, config.seed,
    )
    if config.max_steps > 0:
        total_steps = config.max_steps
    else:
        total_steps = math.ceil(config.num_train_epochs * order.steps_per_epoch)
    if total_steps == 0 or order.steps_per_epoch == 0:
        raise CoSpecError(
            f"{len(train_ids)} training rollouts do not fill one global batch of "
            f"{order.examples_per_step} (per-device batch x processes x accumulation steps)"
        )
    rollout_ids = dataset.select_columns(["rollout_id"])[train_ids]["rollout_id"]
    fingerprint = hashlib.sha256("\n".join(rollout_ids).encode()).hexdigest()[:16]
    accelerator.print(
        f"stage 1: {len(train_ids)} training / {len(eval_ids)} held-out rollouts, K={k}, "
        f"{world} process(es), {order.examples_per_step} rollouts per step, "
        f"{total_steps} steps ({order.steps_per_epoch} per epoch)"
    )

    # ---- model ---------------------------------------------------------------------------
    set_seed(config.seed)
    arbiter = build_arbiter(model_config, k, config.head_layout)
    if config.activation_checkpointing:
        base = arbiter.peft_model.get_base_model()
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pad_token_id = arbiter._pad_token_id
    trainable = [p for p in arbiter.parameters() if p.requires_grad]
    accelerator.print(
        f"arbiter: {sum(p.numel() for p in trainable):,} trainable parameters "
        f"(LoRA + head) of {sum(p.numel() for p in arbiter.parameters()):,}"
    )
    model = PackedScorer(arbiter).train()

    # ---- optimizer and schedule ----------------------------------------------------------
    optimizer = torch.optim.AdamW(
        trainable, lr=config.learning_rate, weight_decay=config.weight_decay,
        betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon,
    )
    warmup = config.warmup_steps
    warmup = math.ceil(warmup * total_steps) if 0 < warmup < 1 else int(warmup)
    scheduler = get_scheduler(config.lr_scheduler_type, optimizer, warmup, total_steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if accelerator.gradient_accumulation_steps != config.gradient_accumulation_steps:
        raise CoSpecError(
            f"the DeepSpeed config sets gradient_accumulation_steps="
            f"{accelerator.gradient_accumulation_steps}; set it to \"auto\""
        )
    checkpoint_trainable_only(accelerator)

    # ---- resume --------------------------------------------------------------------------
    step = 0
    if resume_path is not None:
        state = load_checkpoint(accelerator, resume_path)
        if (state.examples_per_step, state.train_fingerprint) != (
            order.examples_per_step, fingerprint
        ):
            raise CoSpecError(
                f"{resume_path} was written with {state.examples_per_step} rollouts per step "
                f"on training data {state.train_fingerprint}; this run has "
                f"{order.examples_per_step} on {fingerprint}: it cannot resume exactly"
            )
        step = state.global_step
        accelerator.print(f"resumed from {resume_path} at step {step}")
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.json").write_text(json.dumps(
            {"sft": asdict(config), "model": asdict(model_config)}, indent=2, default=str
        ) + "\n")
    log = MetricsLog(output_dir, accelerator, resume_step=step)
    accelerator.init_trackers("cospec-sft", config={
        k_: v for k_, v in asdict(config).items() if isinstance(v, int | float | str | bool)
    })

    def evaluate() -> dict[str, float]:
        return evaluate_arbiter(
            accelerator, model, dataset, eval_ids, config.per_device_eval_batch_size, k,
            pad_token_id,
        )

    # ---- train ---------------------------------------------------------------------------
    window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
    while step < total_steps:
        batches = [
            collate_rollouts(dataset[[train_ids[i] for i in indices]], k, pad_token_id)
            for indices in order.micro_batches(step, rank)
        ]
        # The loss is the weighted mean over the whole global batch: every rank needs its
        # total weight before the first backward.
        local_weight = sum(batch.weights.sum() for batch in batches).to(accelerator.device)
        global_weight = accelerator.reduce(local_weight, reduction="sum")
        # Gradients are averaged over ranks (DDP / ZeRO) and accumulation steps scale the
        # loss by 1 / G; this factor turns the result back into a sum over the global batch.
        scale = world * config.gradient_accumulation_steps / global_weight
        loss_sum = torch.zeros((), device=accelerator.device)
        grad_norm = None
        for batch in batches:
            batch = batch.to(accelerator.device)
            with accelerator.accumulate(model):
                logits = model(**vars(batch.packed))
                loss = weighted_bce_sum(logits, batch.positions, batch.labels, batch.weights)
                accelerator.backward(loss * scale)
                loss_sum += loss.detach()
                if accelerator.sync_gradients:  # the last micro-batch of the step
                    if config.max_grad_norm:
                        grad_norm = accelerator.clip_grad_norm_(trainable, config.max_grad_norm)
                    learning_rate = scheduler.get_last_lr()[0]
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
        step += 1
        window_loss += (accelerator.reduce(loss_sum, reduction="sum") / global_weight).item()
        window_steps += 1

        if step % config.logging_steps == 0 or step == total_steps:
            elapsed = time.perf_counter() - window_start
            log.log("train", step, {
                "loss": window_loss / window_steps,
                "learning_rate": learning_rate,
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "epoch": step / order.steps_per_epoch,
                "rollouts_per_second": window_steps * order.examples_per_step / elapsed,
            })
            window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
        if config.eval_steps and step % config.eval_steps == 0 and step < total_steps:
            log.log("eval", step, evaluate())
            log.plot()
        if config.save_steps and step % config.save_steps == 0:
            save_checkpoint(
                accelerator, output_dir,
                TrainerState(step, order.examples_per_step, fingerprint),
                config.save_total_limit,
            )
        if stop_after_step is not None and step >= stop_after_step and step < total_steps:
            accelerator.end_training()
            return None

    # ---- final evaluation and save -------------------------------------------------------
    metrics = evaluate()
    log.log("eval", step, metrics)
    log.plot()
    in_sync = replicas_in_sync(accelerator, model)
    arbiter_dir = output_dir / ARBITER_DIR
    save_arbiter(accelerator, accelerator.unwrap_model(model).arbiter, arbiter_dir)
    summary = {
        "steps": step,
        "training_rollouts": len(train_ids),
        "held_out_rollouts": len(eval_ids),
        "rollouts_per_step": order.examples_per_step,
        "processes": world,
        "replicas_in_sync": in_sync,
        **{f"held_out_{name}": value for name, value in metrics.items()},
    }
    if accelerator.is_main_process:
        (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        accelerator.print(f"saved the arbiter to {arbiter_dir}: held-out AUC "
                          f"{metrics['auc']:.3f}, accuracy {metrics['accuracy']:.3f}, "
                          f"ECE {metrics['ece']:.3f}, BCE {metrics['bce']:.4f}")
        if config.push_to_hub:
            url = push_to_hub(arbiter_dir, config.hub_model_id,
                              private=config.hub_private_repo, training_summary=summary)
            accelerator.print(f"pushed the arbiter to {url}")
    accelerator.end_training()
    return metrics


def build_arbiter(model_config: ModelConfig, num_draft_tokens: int, head_layout: str
                  ) -> ArbiterModel:
    """The drafter from ``model_name_or_path`` with a fresh LoRA adapter and head.

    The arbiter always carries an adapter, so the LoRA fields apply whatever ``use_peft``
    says; without ``lora_target_modules`` it goes on the attention projections (q/k/v/o),
    as :meth:`ArbiterModel.from_drafter` does.
    """
    if not model_config.model_name_or_path:
        raise CoSpecError("model_name_or_path is required: the drafter the arbiter sits on")
    if model_config.load_in_4bit or model_config.load_in_8bit:
        raise CoSpecError("quantised drafters (load_in_4bit / load_in_8bit) are not supported")
    drafter = load_model(
        model_config.model_name_or_path,
        dtype=model_config.dtype or "float32",
        attn_implementation=model_config.attn_implementation or "sdpa",
    )
    targets = model_config.lora_target_modules or list(DEFAULT_TARGET_MODULES)
    lora = get_peft_config(replace(model_config, use_peft=True, lora_target_modules=targets))
    return ArbiterModel.from_drafter(
        drafter, num_draft_tokens=num_draft_tokens, head_layout=head_layout, lora=lora,
        base_model=model_config.model_name_or_path,
    )


@torch.no_grad()
def evaluate_arbiter(
    accelerator, model: nn.Module, dataset: Dataset, eval_ids: Sequence[int],
    per_device_batch_size: int, num_draft_tokens: int, pad_token_id: int,
) -> dict[str, float]:
    """Held-out metrics over every judged mismatch of the held-out rollouts (all ranks)."""
    model.eval()
    logits, labels, weights = [], [], []
    for indices, num_real in eval_batches(
        len(eval_ids), per_device_batch_size, accelerator.num_processes, accelerator.process_index
    ):
        rows = dataset[[eval_ids[i] for i in indices]]
        batch = collate_rollouts(rows, num_draft_tokens, pad_token_id).to(accelerator.device)
        selected = mismatch_logits(model(**vars(batch.packed)), batch.positions)
        keep = batch.weights[:num_real] > 0
        logits += selected[:num_real][keep].float().cpu().tolist()
        labels += batch.labels[:num_real][keep].cpu().tolist()
        weights += batch.weights[:num_real][keep].cpu().tolist()
    model.train()
    return binary_metrics(
        gather_lists(accelerator, logits),
        gather_lists(accelerator, labels),
        gather_lists(accelerator, weights),
    )


if __name__ == "__main__":
    try:
        main()
    except CoSpecError as err:
        sys.exit(f"trainers.sft: error: {err}")
