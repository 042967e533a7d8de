"""The slim verifier: shared weights, real skipping, an untouched target, a working KV cache."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from cospec.errors import CoSpecError
from cospec.slim import RoutingMask, build_slim_verifier

# Layer 1 skipped whole, layer 2 attention only, layer 3 MLP only (of 5 layers).
SOME_SKIPS = RoutingMask(
    skip_attention=[False, True, True, False, False],
    skip_mlp=[False, True, False, True, False],
)


def _ids(vocab_size: int, batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch, length), generator=generator)


def _zeroed_reference(target, mask: RoutingMask):
    """An independent reference: a deep copy whose skipped sublayers write zeros.

    A Llama sublayer with a zero output projection (no bias) adds exactly nothing to the
    residual stream, which is what skipping it means.
    """
    reference = copy.deepcopy(target)
    for layer, skip_attention, skip_mlp in zip(
        reference.model.layers, mask.skip_attention, mask.skip_mlp, strict=True
    ):
        if skip_attention:
            layer.self_attn.o_proj.weight.data.zero_()
        if skip_mlp:
            layer.mlp.down_proj.weight.data.zero_()
    return reference


@torch.no_grad()
def test_mask_that_skips_nothing_reproduces_target_logits(tiny_llama):
    target = tiny_llama(num_layers=3)
    ids = _ids(target.config.vocab_size)
    slim = build_slim_verifier(target, RoutingMask.none(3))
    assert torch.equal(slim(ids).logits, target(ids).logits)


@torch.no_grad()
def test_skipped_sublayers_match_a_model_with_zeroed_sublayers(tiny_llama):
    target = tiny_llama(num_layers=5)
    ids = _ids(target.config.vocab_size)
    slim_logits = build_slim_verifier(target, SOME_SKIPS)(ids).logits
    expected = _zeroed_reference(target, SOME_SKIPS)(ids).logits
    torch.testing.assert_close(slim_logits, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(slim_logits, target(ids).logits, atol=1e-3)


@torch.no_grad()
def test_slim_verifier_shares_weights_and_leaves_target_unaffected(tiny_llama):
    target = tiny_llama(num_layers=5)
    ids = _ids(target.config.vocab_size)
    before = target(ids).logits
    target_params = dict(target.named_parameters())
    layer_types = [
        (type(layer.self_attn), type(layer.mlp), type(layer.input_layernorm))
        for layer in target.model.layers
    ]

    slim = build_slim_verifier(target, SOME_SKIPS)
    slim(ids)

    slim_params = dict(slim.named_parameters())
    assert slim_params.keys() < target_params.keys()
    for name, param in slim_params.items():
        assert param.data_ptr() == target_params[name].data_ptr(), name
    assert slim.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert slim.model.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    # The skipped sublayers' weights are not reachable from the slim verifier at all.
    assert "model.layers.1.self_attn.q_proj.weight" not in slim_params
    assert "model.layers.3.mlp.down_proj.weight" not in slim_params

    assert torch.equal(target(ids).logits, before)
    assert layer_types == [
        (type(layer.self_attn), type(layer.mlp), type(layer.input_layernorm))
        for layer in target.model.layers
    ]
    assert len(dict(target.named_parameters())) == len(target_params)


@torch.no_grad()
def test_output_hidden_states_stay_right_for_both_models(tiny_llama):
    """HF's lazily installed output-capturing hooks must not double up on shared modules."""
    target = tiny_llama(num_layers=5, attn_implementation="eager")
    ids = _ids(target.config.vocab_size)
    reference = copy.deepcopy(target)(ids, output_hidden_states=True, output_attentions=True)
    slim = build_slim_verifier(target, SOME_SKIPS)

    slim_out = slim(ids, output_hidden_states=True, output_attentions=True)
    target_out = target(ids, output_hidden_states=True, output_attentions=True)

    assert len(slim_out.hidden_states) == 6
    assert len(slim_out.attentions) == 3  # layers 1 and 2 skip their attention
    assert len(target_out.hidden_states) == 6
    assert len(target_out.attentions) == 5
    for got, expected in zip(target_out.hidden_states, reference.hidden_states, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@torch.no_grad()
def test_incremental_decoding_matches_full_forward(tiny_llama, attn_implementation):
    """Prefill, single tokens and a multi-token chunk, with left padding and explicit positions."""
    target = tiny_llama(num_layers=5, attn_implementation=attn_implementation)
    slim = build_slim_verifier(target, SOME_SKIPS)
    ids = _ids(target.config.vocab_size, batch=2, length=14)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0  # row 1 is left-padded by three tokens
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    full = slim(ids, attention_mask=attention_mask, position_ids=position_ids).logits

    cache = DynamicCache(config=slim.config)
    pieces = []
    # prefill 6, then 1, 1, then a chunk of 4, then 2
    for start, end in ((0, 6), (6, 7), (7, 8), (8, 12), (12, 14)):
        out = slim(
            ids[:, start:end],
            attention_mask=attention_mask[:, :end],
            position_ids=position_ids[:, start:end],
            cache=cache,
        )
        pieces.append(out.logits)
    incremental = torch.cat(pieces, dim=1)

    valid = attention_mask.bool()
    torch.testing.assert_close(incremental[valid], full[valid], rtol=1e-5, atol=1e-5)
    skipped_attention = [i for i, skip in enumerate(SOME_SKIPS.skip_attention) if skip]
    assert [cache.layers[i].get_seq_length() for i in range(5)] == [
        0 if i in skipped_attention else 14 for i in range(5)
    ]


@torch.no_grad()
def test_cache_rollback_then_redecode_matches_full_forward(tiny_llama):
    """Cropping the slim cache (rejected tokens) leaves it consistent, empty layers included."""
    target = tiny_llama(num_layers=5)
    slim = build_slim_verifier(target, SOME_SKIPS)
    ids = _ids(target.config.vocab_size, batch=1, length=10)
    full = slim(ids).logits

    cache = DynamicCache(config=slim.config)
    slim(ids[:, :6], cache=cache)
    slim(_ids(target.config.vocab_size, batch=1, length=3, seed=1), cache=cache)  # rejected
    cache.crop(-3)
    redone = slim(ids[:, 6:], cache=cache).logits
    torch.testing.assert_close(redone, full[:, 6:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("skip_attention", "skip_mlp", "message"),
    [
        ([True, False, False, False], [False] * 4, "layer 0"),
        ([False] * 4, [True, False, False, False], "layer 0"),
        ([False] * 4, [False, False, False, True], "last layer"),
        ([False, False, False, True], [False] * 4, "last layer"),
        ([False] * 4, [False] * 3, "entries"),
    ],
)
def test_mask_refuses_first_and_last_layer_skips(skip_attention, skip_mlp, message):
    with pytest.raises(CoSpecError, match=message):
        RoutingMask(skip_attention, skip_mlp)


def test_mask_of_wrong_length_for_model_is_refused(tiny_llama):
    target = tiny_llama(num_layers=3)
    with pytest.raises(CoSpecError, match="routing mask has 5 layers but LlamaForCausalLM has 3"):
        build_slim_verifier(target, SOME_SKIPS)


def test_skip_ratio_counts_sublayers():
    assert SOME_SKIPS.num_skipped == 4
    assert SOME_SKIPS.skip_ratio == pytest.approx(4 / 10)
    assert RoutingMask.none(6).skip_ratio == 0
    assert SOME_SKIPS.skipped_names() == ["1.attention", "1.mlp", "2.attention", "3.mlp"]


def test_mask_json_round_trip(tmp_path):
    mask = RoutingMask(SOME_SKIPS.skip_attention, SOME_SKIPS.skip_mlp, model="toy:target")
    path = tmp_path / "mask.json"
    mask.save(path)
    assert RoutingMask.load(path) == mask
    unnamed = RoutingMask.none(4)
    unnamed.save(path)
    assert RoutingMask.load(path) == unnamed


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (
            '{"num_layers": 3, "skip_attention": [false, false], "skip_mlp": [false, false]}',
            "num_layers=3",
        ),
        (
            '{"num_layers": 2, "skip_attention": [0, 0], "skip_mlp": [false, false]}',
            "list of booleans",
        ),
    ],
)
def test_broken_mask_file_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "mask.json"
    path.write_text(content)
    with pytest.raises(CoSpecError, match=message):
        RoutingMask.load(path)
    with pytest.raises(CoSpecError, match="cannot read"):
        RoutingMask.load(tmp_path / "missing.json")


def test_unsupported_architecture_is_refused():
    config = GPT2Config(vocab_size=50, n_embd=16, n_layer=3, n_head=2, n_positions=32)
    with pytest.raises(CoSpecError, match="Llama/Qwen layout"):
        build_slim_verifier(GPT2LMHeadModel(config), RoutingMask.none(3))


def test_first_layer_of_an_attention_type_keeps_its_attention():
    """The cache mask of sliding-window layers is built from the first sliding layer."""
    config = Qwen2Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=2,
    )
    target = Qwen2ForCausalLM(config).eval()
    assert config.layer_types.index("sliding_attention") == 2
    build_slim_verifier(target, RoutingMask([False, True, False, False, False], [False] * 5))
    with pytest.raises(CoSpecError, match=r"layer\(s\) \[2\]"):
        build_slim_verifier(target, RoutingMask([False, False, True, False, False], [False] * 5))
