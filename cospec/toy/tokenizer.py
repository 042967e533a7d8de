"""The toy world's character-level tokenizer, shared by every toy model.

One character is one token, so a drafter and a target trained separately still agree on
every token id, which speculative decoding requires. It is a stock
``PreTrainedTokenizerFast``, saved next to each model, so toy and real models load through
the same ``AutoTokenizer`` path.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = string.ascii_letters + string.digits + " \n" + ".,?!:;'\"#+-*/=()$%<>_"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the tokenizer: specials first, then one id per character; prepends ``<bos>``."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_input_names=["input_ids", "attention_mask"],
    )
