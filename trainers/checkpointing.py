"""Checkpoints and the final arbiter, shared by the training recipes.

A checkpoint ``<output_dir>/checkpoint-<step>/`` is ``accelerator.save_state`` (model,
optimizer, scheduler, every rank's RNG states, the accumulation counter) plus
``trainer_state.json`` (the optimizer step, which fixes the data position, see
:mod:`trainers.distributed`). Only trainable parameters are written (the LoRA adapter and
the head): the frozen base is the drafter, reloaded from its own files. ``trainer_state.json``
is written last, so a checkpoint cut short by a kill is never taken for the latest one.

The final arbiter is written with :meth:`ArbiterModel.save_pretrained` from the unwrapped
model; under ZeRO-3 the trainable parameters are gathered first.
"""

from __future__ import annotations

import json
import re
import shutil
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from cospec.arbiter import ArbiterModel
from cospec.errors import CoSpecError
from trainers.distributed import is_zero3

CHECKPOINT_PREFIX = "checkpoint-"
TRAINER_STATE_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    """What a checkpoint records besides ``save_state``: enough to resume the data exactly."""

    global_step: int
    examples_per_step: int
    train_fingerprint: str  # changes if the training rollouts or the split change

    def save(self, directory: Path) -> None:
        (directory / TRAINER_STATE_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> TrainerState:
        return cls(**json.loads((directory / TRAINER_STATE_FILE).read_text()))


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``output_dir``, oldest first."""
    directory = Path(output_dir)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", path.name)
        if match and (path / TRAINER_STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def resolve_resume_checkpoint(
    output_dir: str | Path, resume_from_checkpoint: str | bool | None
) -> Path | None:
    """``resume_from_checkpoint``: a path, or true for the latest one in ``output_dir``.

    True with no checkpoint yet starts from scratch (the same command can start and restart
    a preemptible job). Starting from scratch into an ``output_dir`` that already has
    checkpoints is refused rather than mixing two runs.
    """
    value = resume_from_checkpoint
    if isinstance(value, str) and value.lower() in ("", "false", "none", "no"):
        value = None
    if isinstance(value, str) and value.lower() in ("true", "latest", "yes"):
        value = True
    existing = list_checkpoints(output_dir)
    if value is None or value is False:
        if existing:
            raise CoSpecError(
                f"{str(output_dir)!r} already has checkpoints (latest {existing[-1].name}); "
                "resume with resume_from_checkpoint=true or choose another output_dir"
            )
        return None
    if value is True:
        return existing[-1] if existing else None
    path = Path(value)
    if not (path / TRAINER_STATE_FILE).is_file():
        raise CoSpecError(f"{str(value)!r} is not a complete checkpoint (no {TRAINER_STATE_FILE})")
    return path


def checkpoint_trainable_only(accelerator: Accelerator) -> None:
    """Make ``save_state`` / ``load_state`` write and read only the trainable parameters.

    Call once after ``prepare``. DDP / single process: state-dict hooks filter what is
    saved and load it back strictly. DeepSpeed: :func:`save_checkpoint` passes
    ``exclude_frozen_parameters``.
    """

    def save_hook(models: list[torch.nn.Module], weights: list[dict], output_dir: str) -> None:
        for i, state in enumerate(weights):  # empty under DeepSpeed, which saves by itself
            trainable = {n for n, p in models[i].named_parameters() if p.requires_grad}
            weights[i] = {k: v for k, v in state.items() if k in trainable}

    def load_hook(models: list[torch.nn.Module], input_dir: str) -> None:
        for i, model in enumerate(models):  # empty under DeepSpeed
            path = Path(input_dir) / ("model.safetensors" if i == 0 else f"model_{i}.safetensors")
            state = load_file(path, device=str(next(model.parameters()).device))
            trainable = {n for n, p in model.named_parameters() if p.requires_grad}
            if set(state) != trainable:
                raise CoSpecError(
                    f"checkpoint {input_dir} does not match the model's trainable parameters "
                    f"(missing {sorted(trainable - set(state))[:3]}, "
                    f"unexpected {sorted(set(state) - trainable)[:3]})"
                )
            model.load_state_dict(state, strict=False)
        models.clear()  # loaded here; accelerate must not load them again

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: str | Path,
    state: TrainerState,
    save_total_limit: int | None = None,
) -> Path:
    """Write ``checkpoint-<step>`` (all ranks call this) and prune old ones on the main rank."""
    path = Path(output_dir) / f"{CHECKPOINT_PREFIX}{state.global_step}"
    kwargs = {}
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        kwargs["exclude_frozen_parameters"] = True
    accelerator.save_state(str(path), **kwargs)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state.save(path)
        if save_total_limit:
            for old in list_checkpoints(output_dir)[:-save_total_limit]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return path


def load_checkpoint(accelerator: Accelerator, path: Path) -> TrainerState:
    """Restore model, optimizer, scheduler and RNG states; return the recorded trainer state."""
    kwargs = {}
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        kwargs["load_module_strict"] = False  # frozen base weights are not in the checkpoint
    accelerator.load_state(str(path), **kwargs)
    return TrainerState.load(path)


def save_arbiter(accelerator: Accelerator, arbiter: ArbiterModel, directory: str | Path) -> None:
    """Write the final arbiter from the main rank (all ranks must call: ZeRO-3 gathers)."""
    gather = nullcontext()
    if is_zero3(accelerator):
        import deepspeed

        trainable = [p for p in arbiter.parameters() if p.requires_grad]
        gather = deepspeed.zero.GatheredParameters(trainable, modifier_rank=None)
    with gather:
        if accelerator.is_main_process:
            arbiter.save_pretrained(directory)
    accelerator.wait_for_everyone()
