"""Loading models and tokenizers: one path for toy and real models.

Everything goes through ``from_pretrained`` with a local directory or a Hub id. The only
extra is the ``toy:NAME`` shorthand, which resolves to the toy world shipped inside the
package (a path, nothing more), so configs work from any working directory.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from cospec.errors import CoSpecError
from cospec.toy.world import TOY_PREFIX, WORLD_MODEL_NAMES, toy_model_path

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(name_or_path: str) -> str:
    """Map ``toy:NAME`` to the shipped toy model; leave paths and Hub ids unchanged."""
    if name_or_path.startswith(TOY_PREFIX):
        name = name_or_path[len(TOY_PREFIX):]
        if name not in WORLD_MODEL_NAMES:
            raise CoSpecError(
                f"unknown toy model {name!r}; choose from {list(WORLD_MODEL_NAMES)}"
            )
        return str(toy_model_path(name))
    return name_or_path


def _looks_like_local_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).exists()


def _check_exists(name_or_path: str, what: str) -> str:
    path = resolve_model_path(name_or_path)
    if _looks_like_local_path(path) and not Path(path).expanduser().is_dir():
        raise CoSpecError(f"{what} path {name_or_path!r} does not exist or is not a directory")
    return path


def load_model(
    name_or_path: str,
    *,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """Load a causal LM in eval mode.

    Only sdpa and eager attention are accepted: the engine and the arbiter pass custom
    masks (holes, hybrid regions), which FlashAttention cannot express.
    """
    if dtype not in DTYPES:
        raise CoSpecError(f"unknown dtype {dtype!r}; choose from {list(DTYPES)}")
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise CoSpecError(
            f"attention implementation {attn_implementation!r} is not supported; choose from "
            f"{list(ATTN_IMPLEMENTATIONS)} (custom masks do not work with FlashAttention)"
        )
    path = _check_exists(name_or_path, "model")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], attn_implementation=attn_implementation
        )
    except (OSError, ValueError) as err:
        raise CoSpecError(f"cannot load model {name_or_path!r}: {_first_line(err)}") from err
    return model.to(device).eval()


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved with a model; left padding, as batched decoding expects."""
    path = _check_exists(name_or_path, "tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise CoSpecError(f"cannot load tokenizer {name_or_path!r}: {_first_line(err)}") from err
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_same_vocabulary(
    target: PreTrainedTokenizerBase,
    drafter: PreTrainedTokenizerBase,
    drafter_name: str,
) -> None:
    """Refuse a drafter whose token ids mean something else than the target's.

    Speculative decoding compares token ids across models, so the vocabularies must be
    identical, not merely the same size.
    """
    if target.get_vocab() != drafter.get_vocab():
        raise CoSpecError(
            f"drafter {drafter_name!r} has a different vocabulary from the target "
            f"({len(drafter)} vs {len(target)} tokens or different ids); speculative decoding "
            "needs the target's tokenizer"
        )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
