"""Distributed pieces shared by the training recipes: the Accelerator, the data order, checks.

The same code runs as one process, under DDP (GPUs, or CPUs over gloo) and under DeepSpeed
ZeRO-2/3, all chosen by the ``accelerate launch`` config; nothing here is a distribution
layer of its own.

Data order: every rank computes the same seeded permutation of the training examples per
epoch. Optimizer step s consumes the s-th slice of ``examples_per_step`` =
``per_device_batch_size * num_processes * gradient_accumulation_steps`` examples; micro-batch
g of rank r is a fixed piece of that slice. So the data order is a pure function of
(seed, step), a checkpoint needs only the step counter to resume the data exactly, and the
content of a global batch does not depend on how it is split across ranks and micro-batches
(1 process x 4 rollouts = 2 processes x 2 = 1 process x 2 x 2 accumulation steps).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, gather_object

from cospec.errors import CoSpecError

REPORT_TO = ("none", "tensorboard", "wandb")


def build_accelerator(
    *,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    max_grad_norm: float,
    report_to: str,
    project_dir: str,
) -> Accelerator:
    """The Accelerator for a recipe, with the DeepSpeed config's ``auto`` batch fields filled.

    The learning-rate scheduler is stepped by the recipe once per optimizer step
    (``step_scheduler_with_optimizer=False``), so its length is in optimizer steps whatever
    the number of processes.
    """
    if report_to not in REPORT_TO:
        raise CoSpecError(f"report_to must be one of {list(REPORT_TO)}, got {report_to!r}")
    _check_tracker_installed(report_to)
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    launched = int(os.environ.get("LOCAL_RANK", -1)) != -1
    no_gpu = not torch.cuda.is_available()
    handlers = []
    if deepspeed and launched and no_gpu:
        # DeepSpeed on CPU (tests, laptops). accelerate skips DeepSpeed when asked for CPU,
        # and sets up no process group for it without a GPU backend: name gloo instead.
        if os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes"):
            raise CoSpecError(
                "DeepSpeed on CPU: leave ACCELERATE_USE_CPU / use_cpu unset (accelerate "
                "ignores DeepSpeed under it); the recipe selects gloo by itself"
            )
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    accelerator = Accelerator(
        # Without CUDA, launched processes join a gloo group (as ACCELERATE_USE_CPU=1 does).
        cpu=no_gpu and not deepspeed,
        gradient_accumulation_steps=gradient_accumulation_steps,
        step_scheduler_with_optimizer=False,
        log_with=None if report_to == "none" else report_to,
        project_dir=project_dir,
        kwargs_handlers=handlers,
    )
    _fill_deepspeed_config(
        accelerator,
        train_micro_batch_size_per_gpu=per_device_train_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        train_batch_size=per_device_train_batch_size
        * gradient_accumulation_steps
        * accelerator.num_processes,
        gradient_clipping=max_grad_norm or 0.0,
    )
    return accelerator


def _check_tracker_installed(report_to: str) -> None:
    if report_to == "none":
        return
    from accelerate.utils import is_tensorboard_available, is_wandb_available

    available = {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available}
    if not available[report_to]():
        raise CoSpecError(f"report_to={report_to!r} needs the {report_to} package: "
                          f"pip install {report_to}")


def _fill_deepspeed_config(accelerator: Accelerator, **values: float) -> None:
    """Replace ``auto`` in the DeepSpeed config by the recipe's values; refuse contradictions."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    config = plugin.deepspeed_config
    for key, value in values.items():
        current = config.get(key, "auto")
        if current == "auto":
            config[key] = value
        elif float(current) != float(value):
            raise CoSpecError(
                f"the DeepSpeed config sets {key}={current}, but the recipe's config gives "
                f"{value}; set it to \"auto\" in the DeepSpeed JSON"
            )


def is_zero3(accelerator: Accelerator) -> bool:
    plugin = accelerator.state.deepspeed_plugin
    return plugin is not None and plugin.zero_stage == 3


@contextmanager
def loading_whole(accelerator: Accelerator) -> Iterator[None]:
    """Load models whole on every process, even under ZeRO-3.

    Under ZeRO-3, ``from_pretrained`` after the Accelerator exists partitions the weights as
    it loads them (``zero.Init``). That is right for the model given to ``prepare``, whose
    engine gathers them; a frozen model used only for decoding (the target) would be left
    with empty weights, so it is loaded outside ``zero.Init``.
    """
    if not is_zero3(accelerator):
        yield
        return
    from transformers.integrations.deepspeed import (
        set_hf_deepspeed_config,
        unset_hf_deepspeed_config,
    )

    # accelerate's zero3_init_context_manager(enable=False) re-creates the HF DeepSpeed
    # config either way (accelerate 1.15, transformers 5.24), so the global that
    # from_pretrained checks is cleared directly and restored from the plugin, which keeps
    # the config object alive.
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(accelerator.state.deepspeed_plugin.dschf)


@contextmanager
def gathered_for_decoding(model: torch.nn.Module, accelerator: Accelerator) -> Iterator[None]:
    """Under ZeRO-3, hold the prepared model's parameters whole while decoding with it.

    Ranks decode different prompts for different numbers of rounds, so a per-forward
    gather (which needs every rank to run the same forwards) would hang: the shards are
    gathered once, and DeepSpeed's forward hooks are off meanwhile (TRL's helpers, the
    approach of its ``unwrap_model_for_generation``). Without ZeRO-3 this does nothing.
    """
    if not is_zero3(accelerator):
        yield
        return
    import deepspeed
    from trl.models.utils import add_hooks, remove_hooks

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        remove_hooks(model)
        try:
            yield
        finally:
            add_hooks(model)


@dataclass(frozen=True)
class BatchOrder:
    """Which examples each rank trains on at each optimizer step (see the module doc)."""

    num_examples: int
    per_device_batch_size: int
    num_processes: int
    gradient_accumulation_steps: int
    seed: int

    @property
    def examples_per_step(self) -> int:
        return self.per_device_batch_size * self.num_processes * self.gradient_accumulation_steps

    @property
    def steps_per_epoch(self) -> int:
        """Whole global batches per epoch (the last partial batch of an epoch is dropped)."""
        return self.num_examples // self.examples_per_step

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        """Example indices of rank ``rank``'s micro-batches at optimizer step ``step``."""
        if self.steps_per_epoch == 0:
            raise CoSpecError(
                f"{self.num_examples} training examples do not fill one global batch of "
                f"{self.examples_per_step} (per-device batch x processes x accumulation steps)"
            )
        epoch, offset = divmod(step, self.steps_per_epoch)
        chunk = _permutation(self.num_examples, self.seed, epoch)[
            offset * self.examples_per_step : (offset + 1) * self.examples_per_step
        ]
        b, world = self.per_device_batch_size, self.num_processes
        return [
            chunk[(g * world + rank) * b : (g * world + rank + 1) * b].tolist()
            for g in range(self.gradient_accumulation_steps)
        ]


@lru_cache(maxsize=2)
def _permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def eval_batches(
    num_examples: int, per_device_batch_size: int, num_processes: int, rank: int
) -> list[tuple[list[int], int]]:
    """This rank's held-out batches as ``(indices, num_real)``.

    Every rank gets the same number of batches, so collective forwards (ZeRO-3 gathers
    parameters in every forward) line up; a rank short of examples repeats example 0 and
    drops those results (only the first ``num_real`` indices count).
    """
    if num_examples == 0:
        return []
    global_batch = per_device_batch_size * num_processes
    batches = []
    for start in range(0, num_examples, global_batch):
        lo = min(start + rank * per_device_batch_size, num_examples)
        hi = min(lo + per_device_batch_size, start + global_batch, num_examples)
        real = list(range(lo, hi))
        batches.append((real or [0], len(real)))
    return batches


def gather_lists(accelerator: Accelerator, values: list[Any]) -> list[Any]:
    """Concatenate a Python list across ranks (same result on every rank)."""
    if accelerator.num_processes == 1:
        return list(values)
    return gather_object(values)


def replicas_in_sync(accelerator: Accelerator, model: torch.nn.Module) -> bool | None:
    """Whether every rank holds the same trainable parameters (DDP); None under ZeRO.

    Compares per-rank float64 checksums of each trainable tensor: a cheap end-of-run check
    that data-parallel training kept the replicas identical.
    """
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return None
    checksums = [
        (p.detach().double().sum().item(), p.detach().double().square().sum().item())
        for p in model.parameters()
        if p.requires_grad
    ]
    if accelerator.num_processes == 1:
        return True
    everyone = gather_object([checksums])
    return all(c == everyone[0] for c in everyone)
