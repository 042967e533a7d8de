"""VIA-SD's slim verifier: the target with some sublayers skipped, sharing all its weights.

A routing mask says which attention and MLP sublayers to skip. The slim verifier is built by
copying only the module *containers* on the path to a skipped sublayer (the CausalLM wrapper,
the decoder model, the affected decoder layers) and swapping the skipped children for
modules that add nothing to the residual stream. Every parameter, the embeddings and the LM
head are the target's own tensors, so the slim verifier costs no memory beyond its own KV
cache, and the target is never modified. Forward hooks could not do this: a hook runs after
the sublayer has already spent its compute.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils.output_capturing import maybe_install_capturing_hooks

from cospec.errors import CoSpecError

# The children of a decoder layer in the Llama/Qwen layout. The stock forward of such a layer
# is `h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h))`, so each norm
# feeds only its own sublayer and can be skipped with it.
LAYER_CHILDREN = frozenset({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"})


@dataclass
class RoutingMask:
    """Which sublayers of each decoder layer the slim verifier skips.

    Layer 0 turns embeddings into the representation every later layer reads, and the last
    layer writes what the LM head reads; skipping either wrecks the distribution, so both
    are always kept whole.
    """

    skip_attention: list[bool]
    skip_mlp: list[bool]
    model: str | None = None

    def __post_init__(self) -> None:
        if len(self.skip_attention) != len(self.skip_mlp):
            raise CoSpecError(
                f"routing mask has {len(self.skip_attention)} attention entries but "
                f"{len(self.skip_mlp)} MLP entries; both need one entry per layer"
            )
        if not self.skip_attention:
            raise CoSpecError("routing mask has no layers")
        last = self.num_layers - 1
        for layer, what in ((0, "layer 0"), (last, f"the last layer ({last})")):
            if self.skip_attention[layer] or self.skip_mlp[layer]:
                raise CoSpecError(
                    f"routing mask skips a sublayer of {what}; the first and the last layer "
                    "are always kept whole"
                )

    @classmethod
    def none(cls, num_layers: int, model: str | None = None) -> RoutingMask:
        """The mask that skips nothing: the slim verifier then equals the target."""
        return cls([False] * num_layers, [False] * num_layers, model)

    @property
    def num_layers(self) -> int:
        return len(self.skip_attention)

    @property
    def num_skipped(self) -> int:
        return sum(self.skip_attention) + sum(self.skip_mlp)

    @property
    def skip_ratio(self) -> float:
        """Skipped sublayers over all sublayers (two per layer)."""
        return self.num_skipped / (2 * self.num_layers)

    def skipped_names(self) -> list[str]:
        """The skipped sublayers as ``"LAYER.attention"`` / ``"LAYER.mlp"``, for reports."""
        names = [f"{i}.attention" for i, skip in enumerate(self.skip_attention) if skip]
        names += [f"{i}.mlp" for i, skip in enumerate(self.skip_mlp) if skip]
        return sorted(names, key=lambda name: int(name.split(".")[0]))

    def save(self, path: str | Path) -> None:
        """Write the mask as JSON; the layer count lets ``load`` catch a truncated file."""
        payload = {
            "model": self.model,
            "num_layers": self.num_layers,
            "skip_attention": self.skip_attention,
            "skip_mlp": self.skip_mlp,
        }
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RoutingMask:
        path = Path(path)
        try:
            payload = json.loads(path.read_text())
        except OSError as err:
            raise CoSpecError(f"cannot read routing mask {str(path)!r}: {err.strerror}") from err
        except json.JSONDecodeError as err:
            raise CoSpecError(f"routing mask {str(path)!r} is not valid JSON: {err.msg}") from err
        if not isinstance(payload, dict):
            raise CoSpecError(f"routing mask {str(path)!r} must hold a JSON object")
        fields = {}
        for key in ("skip_attention", "skip_mlp"):
            value = payload.get(key)
            if not isinstance(value, list) or not all(isinstance(v, bool) for v in value):
                raise CoSpecError(f"routing mask {str(path)!r}: {key!r} must be a list of booleans")
            fields[key] = value
        num_layers = payload.get("num_layers")
        if num_layers != len(fields["skip_attention"]):
            raise CoSpecError(
                f"routing mask {str(path)!r} declares num_layers={num_layers!r} but lists "
                f"{len(fields['skip_attention'])} layers"
            )
        model = payload.get("model")
        if model is not None and not isinstance(model, str):
            raise CoSpecError(f"routing mask {str(path)!r}: 'model' must be a string or null")
        return cls(fields["skip_attention"], fields["skip_mlp"], model)


class _SkippedAttention(nn.Module):
    """Stands in for a skipped self-attention: a zero update, and nothing written to the cache."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, None]:
        return hidden_states.new_zeros(()), None


class _SkippedMLP(nn.Module):
    """Stands in for a skipped MLP: a zero update."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.new_zeros(())


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The target's decoder layers, after checking they follow the Llama/Qwen layout."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(
        set(dict(layer.named_children())) == LAYER_CHILDREN for layer in layers
    ):
        raise CoSpecError(
            f"cannot build a slim verifier for {type(model).__name__}: it needs the Llama/Qwen "
            "layout model.model.layers[i] with exactly self_attn, mlp, input_layernorm and "
            "post_attention_layernorm"
        )
    return layers


def attention_anchor_layers(config: PretrainedConfig) -> set[int]:
    """Layers whose attention must run for the KV cache to stay usable.

    HF builds each attention type's mask from the cache length of the *first* layer of that
    type; a skipped attention stores nothing, so that layer must keep its attention. For
    models with one attention type this is just layer 0.
    """
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return {layer_types.index(kind) for kind in set(layer_types)}


def _detached_copy(module: nn.Module) -> nn.Module:
    """A shallow copy whose child registry and hooks are its own.

    ``copy.copy`` alone would share the ``_modules`` dict, so swapping a child of the copy
    would swap it in the target too. Parameters stay the very same tensors.
    """
    if "forward" in vars(module) or getattr(module, "_compiled_call_impl", None) is not None:
        raise CoSpecError(
            f"cannot build a slim verifier from a patched {type(module).__name__} (accelerate "
            "device_map hooks or torch.compile): build it from the plain model, then wrap it"
        )
    clone = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set)):
            clone.__dict__[key] = copy.copy(value)
    return clone


def build_slim_verifier(model: PreTrainedModel, mask: RoutingMask) -> PreTrainedModel:
    """The target with the masked sublayers skipped, sharing every weight with it.

    The result is a regular HF causal LM (same forward signature, same config object). Give
    it its own cache, e.g. ``DynamicCache(config=slim.config)``: a skipped attention stores
    nothing in its layer of that cache. Unmasked layers are the target's own layer objects.
    """
    layers = decoder_layers(model)
    if mask.num_layers != len(layers):
        raise CoSpecError(
            f"routing mask has {mask.num_layers} layers but {type(model).__name__} has "
            f"{len(layers)}; was it searched for another model?"
        )
    anchors = sorted(i for i in attention_anchor_layers(model.config) if mask.skip_attention[i])
    if anchors:
        raise CoSpecError(
            f"routing mask skips the attention of layer(s) {anchors}, the first layer of an "
            "attention type; the KV cache mask is built from those layers, so they must be kept"
        )
    # HF installs its output-capturing hooks (output_hidden_states / output_attentions) lazily
    # on first use. Installed after the split, they would land twice on the modules both
    # models share; installed now, the copies inherit them and the flag saying they exist.
    maybe_install_capturing_hooks(model.model)
    slim_layers = nn.ModuleList()
    for layer, skip_attention, skip_mlp in zip(
        layers, mask.skip_attention, mask.skip_mlp, strict=True
    ):
        if not (skip_attention or skip_mlp):
            slim_layers.append(layer)
            continue
        slim_layer = _detached_copy(layer)
        if skip_attention:
            slim_layer.input_layernorm = nn.Identity()
            slim_layer.self_attn = _SkippedAttention()
        if skip_mlp:
            slim_layer.post_attention_layernorm = nn.Identity()
            slim_layer.mlp = _SkippedMLP()
        slim_layers.append(slim_layer)
    slim_inner = _detached_copy(model.model)
    slim_inner.layers = slim_layers
    slim = _detached_copy(model)
    slim.model = slim_inner
    return slim
