"""The arbiter: a LoRA adapter on the drafter's base model plus a scalar accept head.

The drafter and the arbiter share one set of base weights: the arbiter is the drafter with
the adapter on, the drafter is the same module with the adapter off (:meth:`drafter`), so
CoSpec costs no second copy of the drafter.

One round is scored with the layout ``[context] [d_1..d_K] [t_1..t_K]`` (see
:mod:`cospec.arbiter.masks`): the context is causal, and its KV can be cached across rounds
because the region never changes it; the region sees the context and itself in both
directions; d_j and t_j both sit at position ``len(context) + j``. The head reads the final
hidden states of d_j and t_j and returns the logit of P(accept d_j).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from cospec.arbiter.masks import attention_mask_for, check_attn_implementation, hybrid_mask
from cospec.arbiter.packing import ArbitratedRound, PackedBatch, pack_rollouts
from cospec.errors import CoSpecError
from cospec.models import load_model

CONFIG_FILE = "arbiter_config.json"
HEAD_FILE = "arbiter_head.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
HEAD_LAYOUTS = ("concat", "sum")
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class ArbiterConfig:
    """What is needed to rebuild an arbiter besides its weights; saved as ``arbiter_config.json``.

    The LoRA fields record the adapter's shape for people and model cards; peft's own
    ``adapter_config.json`` next to it is what loading uses.
    """

    base_model: str = field(metadata={"help": "Hub id or path of the drafter's base model."})
    num_draft_tokens: int = field(metadata={"help": "K, the block length the arbiter scores."})
    head_layout: str = field(
        default="concat",
        metadata={"help": "How the head combines d_j and t_j hidden states: concat or sum."},
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | str = field(
        default_factory=lambda: list(DEFAULT_TARGET_MODULES),
        metadata={"help": "Modules that carry the adapter (names, or one peft regex)."},
    )

    def __post_init__(self) -> None:
        if self.head_layout not in HEAD_LAYOUTS:
            raise CoSpecError(
                f"unknown arbiter head layout {self.head_layout!r}; "
                f"choose from {list(HEAD_LAYOUTS)}"
            )
        if self.num_draft_tokens < 1:
            raise CoSpecError(f"num_draft_tokens must be at least 1, got {self.num_draft_tokens}")

    def lora_config(self) -> LoraConfig:
        """The peft config these fields describe."""
        return LoraConfig(
            r=self.lora_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=self.lora_target_modules,
            task_type="CAUSAL_LM",
        )

    def save(self, directory: str | Path) -> None:
        path = Path(directory) / CONFIG_FILE
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> ArbiterConfig:
        path = Path(directory) / CONFIG_FILE
        if not path.is_file():
            raise CoSpecError(
                f"{str(directory)!r} is not a saved arbiter: {CONFIG_FILE} is missing"
            )
        values = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise CoSpecError(f"{path} has unknown fields {unknown}")
        return cls(**values)


class ArbiterModel(nn.Module):
    """Drafter base + LoRA adapter + accept head. Build with :meth:`from_drafter` or :meth:`load`.

    Caution: the adapter is injected into the base model in place, so after construction
    the drafter model object carries the adapter (on by default). Run it as the drafter
    inside ``with arbiter.drafter() as drafter:``. The adapter is on by default rather
    than only during arbiter forwards because training may recompute forwards during the
    backward pass (activation checkpointing), which must see the adapter as it was.
    """

    def __init__(self, peft_model: PeftModel, config: ArbiterConfig) -> None:
        super().__init__()
        check_attn_implementation(peft_model.get_base_model().config._attn_implementation)
        hidden_size = peft_model.get_base_model().config.hidden_size
        in_features = 2 * hidden_size if config.head_layout == "concat" else hidden_size
        self.peft_model = peft_model
        self._tuner_layer_cache: list[BaseTunerLayer] | None = None
        # fp32 whatever the base dtype: it is tiny, and the BCE / policy losses want fp32 logits.
        self.head = nn.Linear(in_features, 1, device=peft_model.device, dtype=torch.float32)
        self.config = config

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_drafter(
        cls,
        drafter_model: PreTrainedModel,
        *,
        num_draft_tokens: int,
        head_layout: str = "concat",
        lora: LoraConfig | None = None,
        base_model: str | None = None,
    ) -> ArbiterModel:
        """A fresh arbiter on ``drafter_model`` (shared, not copied; see the class note).

        ``lora`` defaults to rank 16 on the attention projections (q/k/v/o), which exist
        under these names in Llama, Qwen, Mistral and Gemma. ``base_model`` is the id or
        path recorded for :meth:`load`; it defaults to the drafter's ``name_or_path``.
        Returned in eval mode.
        """
        check_attn_implementation(drafter_model.config._attn_implementation)
        base_model = drafter_model.name_or_path if base_model is None else base_model
        config = ArbiterConfig(base_model, num_draft_tokens, head_layout)
        peft_model = get_peft_model(drafter_model, config.lora_config() if lora is None else lora)
        # Record the adapter as peft resolved it (target_modules=None means per-architecture
        # defaults, filled in by get_peft_model).
        lora = peft_model.peft_config[peft_model.active_adapter]
        targets = lora.target_modules
        config = replace(
            config,
            lora_r=lora.r,
            lora_alpha=lora.lora_alpha,
            lora_dropout=lora.lora_dropout,
            lora_target_modules=targets if isinstance(targets, str) else sorted(targets),
        )
        return cls(peft_model, config).eval()

    @classmethod
    def load(
        cls,
        directory: str | Path,
        base_model: PreTrainedModel | None = None,
        *,
        trainable: bool = False,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        attn_implementation: str = "sdpa",
    ) -> ArbiterModel:
        """Restore an arbiter saved by :meth:`save_pretrained`, in eval mode.

        Without ``base_model`` the recorded base is loaded through
        :func:`cospec.models.load_model` (``dtype``, ``device`` and ``attn_implementation``
        apply to it). ``trainable`` leaves the adapter's weights trainable (stage 2 starts
        from the stage-1 arbiter).
        """
        directory = Path(directory)
        config = ArbiterConfig.load(directory)
        for name, what in ((HEAD_FILE, "head"), (ADAPTER_FILE, "adapter")):
            if not (directory / name).is_file():
                raise CoSpecError(
                    f"arbiter directory {str(directory)!r} has no {what} weights ({name})"
                )
        if base_model is None:
            if not config.base_model:
                raise CoSpecError(
                    f"arbiter in {str(directory)!r} records no base model; pass base_model"
                )
            base_model = load_model(
                config.base_model,
                dtype=dtype,
                device=device,
                attn_implementation=attn_implementation,
            )
        check_attn_implementation(base_model.config._attn_implementation)
        peft_model = PeftModel.from_pretrained(base_model, directory, is_trainable=trainable)
        arbiter = cls(peft_model, config)
        try:
            head_state = load_file(directory / HEAD_FILE, device=str(arbiter.device))
            arbiter.head.load_state_dict(head_state)
        except RuntimeError as err:
            raise CoSpecError(
                f"head weights in {str(directory)!r} do not fit this arbiter "
                f"({config.head_layout} layout, hidden size "
                f"{base_model.config.hidden_size})"
            ) from err
        return arbiter.eval()

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the adapter (peft format), the head (safetensors) and ``arbiter_config.json``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.peft_model.save_pretrained(
            directory, selected_adapters=[self.peft_model.active_adapter]
        )
        save_file(
            {k: v.contiguous() for k, v in self.head.state_dict().items()}, directory / HEAD_FILE
        )
        self.config.save(directory)

    # ---- the drafter view ---------------------------------------------------------------

    @contextmanager
    def drafter(self) -> Iterator[PreTrainedModel]:
        """The drafter: the shared causal LM with the adapter off, for the ``with`` block.

        The engine enters this every round, so it flips the tuner layers' disable flag
        directly instead of using peft's ``disable_adapter()``, which inspects the whole
        model and resets requires_grad flags on each call (several ms per call on a tiny
        model). The drafter view never trains, so requires_grad can stay as it is.
        """
        layers = self._tuner_layers()
        previous = [layer._disable_adapters for layer in layers]
        for layer in layers:
            layer._disable_adapters = True
        try:
            yield self.peft_model.get_base_model()
        finally:
            for layer, flag in zip(layers, previous, strict=True):
                layer._disable_adapters = flag

    def _tuner_layers(self) -> list[BaseTunerLayer]:
        if self._tuner_layer_cache is None:
            self._tuner_layer_cache = [m for m in self.peft_model.modules()
                                       if isinstance(m, BaseTunerLayer)]
        return self._tuner_layer_cache

    # ---- forwards -----------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def attn_implementation(self) -> str:
        return self.peft_model.get_base_model().config._attn_implementation

    def encode(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        """Final (normed) hidden states [B, Q, H] of the adapted base under a custom mask.

        ``mask`` is a boolean [B, 1, Q, KV] mask (True = attend) with KV = cached columns +
        Q; it is converted here to what the attention implementation needs. Skips the LM
        head: the arbiter never needs vocabulary logits.
        """
        decoder = self.peft_model.get_base_model().get_decoder()
        attention_mask = attention_mask_for(mask, self.attn_implementation, self.peft_model.dtype)
        output = decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
        )
        return output.last_hidden_state

    def head_logits(self, draft_hidden: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """Accept logits [...] from the hidden states [..., H] of d_j and t_j."""
        if self.config.head_layout == "concat":
            features = torch.cat([draft_hidden, target_hidden], dim=-1)
        else:
            features = draft_hidden + target_hidden
        return self.head(features.to(self.head.weight.dtype)).squeeze(-1)

    def score_round(
        self,
        context_ids_new: torch.Tensor,
        context_mask: torch.Tensor,
        context_positions: torch.Tensor,
        cache: DynamicCache | None,
        draft_block: torch.Tensor,
        target_block: torch.Tensor,
    ) -> torch.Tensor:
        """Accept logits [B, K] for every block position of one round, in one forward.

        The batch shares one column layout of C context columns (left padding and holes
        included). ``cache`` holds the arbiter's KV of the first ``cache.get_seq_length()``
        of them; with ``cache=None`` nothing is cached and all C columns must be passed.

        Args:
            context_ids_new: [B, C_new] token ids of the context columns the cache has not
                seen (may have zero columns). Padding and hole columns may hold any id.
            context_mask: [B, C] validity of ALL context columns (1 = real token; 0 = left
                padding or hole, never attended). Columns must be final when fed: a column
                already in the cache must not change validity later.
            context_positions: [B, C_new] position ids of the new columns (a real token's
                position is the number of real tokens before it in its row).
            cache: the arbiter's context cache, or None. On return it covers exactly the C
                context columns: the region is cropped off again.
            draft_block: [B, K] draft tokens d_1..d_K.
            target_block: [B, K] target tokens t_1..t_K.

        d_j and t_j take position ``n + j`` (j = 0..K-1), n = real tokens in the row's
        context.
        """
        batch_size, k = draft_block.shape
        num_new = context_ids_new.shape[1]
        num_context = context_mask.shape[1]
        num_cached = 0 if cache is None else cache.get_seq_length()
        if k != self.config.num_draft_tokens:
            raise CoSpecError(
                f"the arbiter was trained for K={self.config.num_draft_tokens} draft tokens, "
                f"the round has {k}"
            )
        if num_cached + num_new != num_context or target_block.shape != draft_block.shape:
            raise ValueError(
                f"cache holds {num_cached} columns and {num_new} are new, but context_mask has "
                f"{num_context}; or blocks differ ({tuple(draft_block.shape)} vs "
                f"{tuple(target_block.shape)})"
            )
        context_mask = context_mask.bool()
        block_positions = context_mask.sum(-1, keepdim=True) + torch.arange(k, device=self.device)
        input_ids = torch.cat([context_ids_new, draft_block, target_block], dim=1)
        position_ids = torch.cat([context_positions, block_positions, block_positions], dim=1)
        full_context = torch.full((batch_size, 1), num_context, device=self.device)
        mask = hybrid_mask(context_mask, full_context, 2 * k, num_queries=num_new + 2 * k)

        hidden = self.encode(input_ids, mask, position_ids, cache)
        if cache is not None:
            cache.crop(-2 * k)  # transformers 5: a negative crop removes that many columns
        return self.head_logits(hidden[:, num_new : num_new + k], hidden[:, num_new + k :])

    def score_packed(
        self, sequence_ids: torch.Tensor, rounds: Sequence[ArbitratedRound]
    ) -> torch.Tensor:
        """Accept logits [N, K] for every arbitrated round of one rollout, in one forward.

        ``sequence_ids`` [S] is the rollout's final committed sequence (prompt included);
        round n saw its first ``rounds[n].context_length`` tokens. Equal to scoring each
        round with :meth:`score_round` on that prefix.
        """
        batch = pack_rollouts(
            [(sequence_ids, rounds)], self.config.num_draft_tokens, self._pad_token_id
        )
        return self.score_packed_batch(batch.to(self.device))[0]

    @contextmanager
    def reference_policy(self, adapter_name: str, head: nn.Linear) -> Iterator[None]:
        """Score with another loaded adapter and head (e.g. the frozen stage-1 policy).

        Used under ``torch.no_grad`` for the KL term of stage 2; the trainable adapter and
        head are restored on exit.
        """
        active, own_head = self.peft_model.active_adapter, self.head
        self.peft_model.set_adapter(adapter_name)
        self.head = head
        try:
            yield
        finally:
            self.peft_model.set_adapter(active)
            self.head = own_head

    def score_packed_batch(self, batch: PackedBatch) -> torch.Tensor:
        """Accept logits [B, N, K] for a batch from :func:`pack_rollouts`.

        Entries where ``batch.round_mask`` is false are padding and meaningless.
        """
        k = self.config.num_draft_tokens
        batch_size, num_rounds = batch.round_mask.shape
        hidden = self.encode(batch.input_ids, batch.mask, batch.position_ids)
        regions = hidden[:, hidden.shape[1] - num_rounds * 2 * k :]
        regions = regions.reshape(batch_size, num_rounds, 2, k, hidden.shape[-1])
        return self.head_logits(regions[:, :, 0], regions[:, :, 1])

    @property
    def _pad_token_id(self) -> int:
        pad = self.peft_model.get_base_model().config.pad_token_id
        return 0 if pad is None else pad
