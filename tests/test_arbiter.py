"""The arbiter model: masks, cached vs uncached vs packed scoring, save/load/publish.

References are independent of the code under test where it matters: a per-row forward of
the real tokens only (no padding, no holes, a hand-built mask), the stock causal forward of
the context, and the drafter's logits computed before the adapter existed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub.errors import OfflineModeIsEnabled
from peft import LoraConfig
from transformers import DynamicCache

from cospec.arbiter import (
    ArbiterModel,
    ArbitratedRound,
    attention_mask_for,
    hybrid_mask,
    pack_rollouts,
    push_to_hub,
)
from cospec.arbiter.hub import model_card
from cospec.arbiter.model import CONFIG_FILE, HEAD_FILE, ArbiterConfig
from cospec.errors import CoSpecError

K = 3
FIRST_TOKEN = 4  # skip the special tokens
BASE_ID = "cospec-test/tiny-drafter"


def random_lora() -> LoraConfig:
    """Random (not zero-initialised) LoRA weights, so adapter on and off really differ."""
    return LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        init_lora_weights=False,
    )


@pytest.fixture
def make_arbiter(tiny_llama):
    def factory(attn_implementation="sdpa", head_layout="concat", drafter=None, base_model=BASE_ID):
        drafter = drafter or tiny_llama(attn_implementation=attn_implementation)
        torch.manual_seed(1)
        return ArbiterModel.from_drafter(
            drafter,
            num_draft_tokens=K,
            head_layout=head_layout,
            lora=random_lora(),
            base_model=base_model,
        )

    return factory


def tokens(vocab_size: int, *shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_TOKEN, vocab_size, shape, generator=generator)


def reference_round(
    arbiter: ArbiterModel, context: torch.Tensor, draft: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """One row, real tokens only, mask written out by hand: causal context, open region."""
    n = len(context)
    ids = torch.cat([context, draft, target])[None]
    block = n + torch.arange(K)
    positions = torch.cat([torch.arange(n), block, block])[None]
    mask = torch.zeros(n + 2 * K, n + 2 * K, dtype=torch.bool)
    mask[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    mask[n:, :] = True
    hidden = arbiter.encode(ids, mask[None, None], positions)[0]
    return arbiter.head_logits(hidden[n : n + K], hidden[n + K :])


def test_hybrid_mask_matches_hand_worked_example():
    # Row: [pad, a, hole, b] then one region of 2 columns seeing all 4 context columns;
    # queries = the last context column and the region.
    context_mask = torch.tensor([[0, 1, 0, 1]], dtype=torch.bool)
    mask = hybrid_mask(context_mask, torch.tensor([[4]]), region_length=2, num_queries=3)
    expected = torch.tensor(
        [
            [0, 1, 0, 1, 0, 0],  # b: causal over real tokens
            [0, 1, 0, 1, 1, 1],  # region: real context + whole region
            [0, 1, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0], expected)
    # A padding query sees only itself (an all-masked row would be NaN under sdpa).
    full = hybrid_mask(context_mask, torch.tensor([[4]]), region_length=2)
    assert torch.equal(full[0, 0, 0], torch.tensor([1, 0, 0, 0, 0, 0], dtype=torch.bool))


@pytest.mark.parametrize(
    ("attn_implementation", "head_layout"), [("sdpa", "concat"), ("eager", "sum")]
)
def test_packed_rollouts_equal_per_round_scoring(
    make_arbiter, tokenizer, attn_implementation, head_layout
):
    arbiter = make_arbiter(attn_implementation, head_layout)
    vocab = len(tokenizer)
    rollouts = []
    for seed, (length, context_lengths) in enumerate([(14, (4, 7, 7, 14)), (9, (3, 9))]):
        sequence = tokens(vocab, length, seed=seed)
        rounds = [
            ArbitratedRound(
                c, tokens(vocab, K, seed=10 * seed + i), tokens(vocab, K, seed=10 * seed + i + 5)
            )
            for i, c in enumerate(context_lengths)
        ]
        rollouts.append((sequence, rounds))

    batch = pack_rollouts(rollouts, K)
    with torch.no_grad():
        packed = torch.sigmoid(arbiter.score_packed_batch(batch))
        for row, (sequence, rounds) in enumerate(rollouts):
            per_round = torch.sigmoid(
                torch.cat(
                    [
                        arbiter.score_round(
                            sequence[None, : r.context_length],
                            torch.ones(1, r.context_length),
                            torch.arange(r.context_length)[None],
                            None,
                            r.draft_tokens[None],
                            r.target_tokens[None],
                        )
                        for r in rounds
                    ]
                )
            )
            assert batch.round_mask[row].sum() == len(rounds)
            torch.testing.assert_close(packed[row, : len(rounds)], per_round, atol=1e-5, rtol=0)
            single = torch.sigmoid(arbiter.score_packed(sequence, rounds))
            torch.testing.assert_close(single, per_round, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_cached_rounds_with_padding_and_holes_equal_uncached(
    make_arbiter, tokenizer, attn_implementation
):
    arbiter = make_arbiter(attn_implementation)
    vocab = len(tokenizer)
    # One column layout for 3 rows: left padding (prompts of 6, 3, 5 tokens), then columns
    # appended per round, some of them holes. Padding and holes hold real-looking ids so
    # attending them by mistake would change the result.
    valid = torch.ones(3, 17, dtype=torch.bool)
    valid[1, :3] = False
    valid[2, :1] = False
    valid[0, 7] = False
    valid[2, [10, 11]] = False
    valid[1, 14] = False
    ids = tokens(vocab, 3, 17, seed=0)
    positions = (valid.cumsum(-1) - 1).clamp(min=0)
    # Context columns known at each round; the repeated 9 is a round with nothing to catch up.
    boundaries = [6, 9, 9, 13, 17]

    cache = DynamicCache(config=arbiter.peft_model.get_base_model().config)
    with torch.no_grad():
        for index, columns in enumerate(boundaries):
            seen = cache.get_seq_length()
            draft = tokens(vocab, 3, K, seed=100 + index)
            target = tokens(vocab, 3, K, seed=200 + index)
            cached = arbiter.score_round(
                ids[:, seen:columns],
                valid[:, :columns],
                positions[:, seen:columns],
                cache,
                draft,
                target,
            )
            assert cache.get_seq_length() == columns
            uncached = arbiter.score_round(
                ids[:, :columns], valid[:, :columns], positions[:, :columns], None, draft, target
            )
            torch.testing.assert_close(cached, uncached, atol=1e-5, rtol=0)
            for row in range(3):
                context = ids[row, :columns][valid[row, :columns]]
                expected = reference_round(arbiter, context, draft[row], target[row])
                torch.testing.assert_close(cached[row], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_region_is_bidirectional_and_leaves_context_alone(
    make_arbiter, tokenizer, attn_implementation
):
    arbiter = make_arbiter(attn_implementation)
    vocab = len(tokenizer)
    n = 8
    context = tokens(vocab, 1, n, seed=0)
    draft = tokens(vocab, 1, K, seed=1)
    target = tokens(vocab, 1, K, seed=2)
    changed = target.clone()
    changed[0, K - 1] = FIRST_TOKEN if target[0, K - 1] != FIRST_TOKEN else FIRST_TOKEN + 1
    config = arbiter.peft_model.get_base_model().config
    decoder = arbiter.peft_model.get_base_model().get_decoder()

    with torch.no_grad():
        caches, logits = [], []
        for block in (target, changed):
            cache = DynamicCache(config=config)
            logits.append(
                arbiter.score_round(
                    context, torch.ones(1, n), torch.arange(n)[None], cache, draft, block
                )
            )
            caches.append(cache)
        # Stock causal forward of the context alone, adapter on: no custom mask involved.
        stock_cache = DynamicCache(config=config)
        stock = decoder(input_ids=context, cache=stock_cache, use_cache=True).last_hidden_state
        ids = torch.cat([context, draft, target], dim=1)
        block_positions = n + torch.arange(K)
        positions = torch.cat([torch.arange(n), block_positions, block_positions])[None]
        mask = hybrid_mask(torch.ones(1, n, dtype=torch.bool), torch.tensor([[n]]), 2 * K)
        hidden = arbiter.encode(ids, mask, positions)

    # t_K changed: every earlier block position sees it (bidirectional region).
    assert (logits[0][0, : K - 1] - logits[1][0, : K - 1]).abs().min() > 1e-6
    # The context never sees the region: same hidden states and cached KV as without it.
    torch.testing.assert_close(hidden[:, :n], stock, atol=1e-5, rtol=0)
    for cache in caches:
        for layer, stock_layer in zip(cache.layers, stock_cache.layers, strict=True):
            torch.testing.assert_close(layer.keys, stock_layer.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(layer.values, stock_layer.values, atol=1e-5, rtol=0)


def test_eager_needs_a_float_mask(make_arbiter, tokenizer):
    """Why masks are converted: eager adds the mask to the scores, so a boolean one is wrong."""
    arbiter = make_arbiter("eager")
    decoder = arbiter.peft_model.get_base_model().get_decoder()
    n = 6
    ids = tokens(len(tokenizer), 1, n + 2 * K, seed=0)
    positions = torch.cat([torch.arange(n), n + torch.arange(K), n + torch.arange(K)])[None]
    mask = hybrid_mask(torch.ones(1, n, dtype=torch.bool), torch.tensor([[n]]), 2 * K)
    with torch.no_grad():
        wrong = decoder(input_ids=ids, attention_mask=mask, position_ids=positions)
        right = arbiter.encode(ids, mask, positions)
        arbiter.peft_model.get_base_model().config._attn_implementation = "sdpa"
        sdpa = arbiter.encode(ids, mask, positions)
    torch.testing.assert_close(right, sdpa, atol=1e-5, rtol=0)
    assert not torch.allclose(wrong.last_hidden_state, right, atol=1e-3)


def test_drafter_is_the_base_with_adapter_off(tiny_llama, make_arbiter, tokenizer):
    drafter = tiny_llama()
    ids = tokens(len(tokenizer), 2, 10, seed=0)
    base_storage = {p.data_ptr() for p in drafter.parameters()}
    with torch.no_grad():
        original = drafter(ids).logits
    arbiter = make_arbiter(drafter=drafter)

    shared = {
        p.data_ptr()
        for name, p in arbiter.named_parameters()
        if "lora_" not in name and not name.startswith("head.")
    }
    assert shared == base_storage  # no second copy of the base weights
    with torch.no_grad(), arbiter.drafter() as as_drafter:
        assert torch.equal(as_drafter(ids).logits, original)
    with torch.no_grad():
        assert not torch.allclose(drafter(ids).logits, original, atol=1e-3)  # adapter on


def test_only_adapter_and_head_are_trained(make_arbiter, tokenizer):
    arbiter = make_arbiter()
    sequence = tokens(len(tokenizer), 10, seed=0)
    rounds = [
        ArbitratedRound(6, tokens(len(tokenizer), K, seed=1), tokens(len(tokenizer), K, seed=2))
    ]
    arbiter.score_packed(sequence, rounds)[0, 1].backward()
    trained = {name for name, p in arbiter.named_parameters() if p.grad is not None}
    assert "head.weight" in trained
    assert any("lora_A" in name for name in trained)
    assert all("lora_" in name or name.startswith("head.") for name in trained)


def test_save_load_round_trip_is_exact(tiny_llama, make_arbiter, tokenizer, tmp_path):
    drafter = tiny_llama()
    drafter.save_pretrained(tmp_path / "drafter")
    arbiter = make_arbiter(drafter=drafter, base_model=str(tmp_path / "drafter"))
    arbiter.save_pretrained(tmp_path / "arbiter")

    loaded = ArbiterModel.load(tmp_path / "arbiter")  # base loaded from the recorded path
    given_base = ArbiterModel.load(tmp_path / "arbiter", base_model=tiny_llama())
    sequence = tokens(len(tokenizer), 12, seed=0)
    rounds = [
        ArbitratedRound(c, tokens(len(tokenizer), K, seed=c), tokens(len(tokenizer), K, seed=c + 1))
        for c in (5, 9)
    ]
    with torch.no_grad():
        expected = arbiter.score_packed(sequence, rounds)
        assert torch.equal(loaded.score_packed(sequence, rounds), expected)
        assert torch.equal(given_base.score_packed(sequence, rounds), expected)
    assert loaded.config == arbiter.config
    assert ArbiterConfig.load(tmp_path / "arbiter").num_draft_tokens == K


def test_load_refuses_incomplete_directory(make_arbiter, tmp_path):
    make_arbiter().save_pretrained(tmp_path)
    (tmp_path / HEAD_FILE).unlink()
    with pytest.raises(CoSpecError, match="no head weights"):
        ArbiterModel.load(tmp_path)
    (tmp_path / CONFIG_FILE).unlink()
    with pytest.raises(CoSpecError, match="not a saved arbiter"):
        ArbiterModel.load(tmp_path)


class RecordingApi:
    """Stands in for ``huggingface_hub.HfApi``: records calls and what would be uploaded."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.uploaded: dict[str, bytes] = {}
        self.fail = fail

    def create_repo(self, repo_id: str, **kwargs) -> str:
        if self.fail:
            raise OfflineModeIsEnabled("Cannot reach the Hub: offline mode is enabled.")
        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs) -> None:
        self.calls.append(("upload_folder", kwargs))
        folder = Path(kwargs["folder_path"])
        self.uploaded = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_push_to_hub_writes_card_and_uploads(make_arbiter, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    make_arbiter().save_pretrained(tmp_path)
    api = RecordingApi()
    summary = {"stage": "sft", "steps": 120, "eval_accuracy": 0.61}

    url = push_to_hub(tmp_path, "someone/arbiter", api=api, training_summary=summary)

    assert url == "https://huggingface.co/someone/arbiter"
    assert [name for name, _ in api.calls] == ["create_repo", "upload_folder"]
    create, upload = api.calls[0][1], api.calls[1][1]
    assert create["repo_id"] == "someone/arbiter" and create["private"] is True
    assert upload["repo_id"] == "someone/arbiter" and Path(upload["folder_path"]) == tmp_path
    assert {
        "adapter_model.safetensors",
        "adapter_config.json",
        HEAD_FILE,
        CONFIG_FILE,
        "README.md",
    } <= set(api.uploaded)
    card = api.uploaded["README.md"].decode()
    _, front_matter, body = card.split("---\n", 2)
    metadata = yaml.safe_load(front_matter)
    assert metadata["base_model"] == BASE_ID
    assert metadata["library_name"] == "peft"
    assert {"cospec", "speculative-decoding"} <= set(metadata["tags"])
    assert "| steps | 120 |" in body and "| eval_accuracy | 0.61 |" in body

    with pytest.raises(CoSpecError, match="cannot push arbiter to 'someone/arbiter'"):
        push_to_hub(tmp_path, "someone/arbiter", api=RecordingApi(fail=True))


def test_model_card_leaves_local_base_out_of_metadata(tmp_path):
    card = model_card(ArbiterConfig(str(tmp_path), K), "someone/arbiter")
    metadata = yaml.safe_load(card.split("---\n", 2)[1])
    assert "base_model" not in metadata
    assert str(tmp_path) in card


def test_flash_attention_is_refused(tiny_llama, make_arbiter):
    drafter = tiny_llama()
    drafter.config._attn_implementation = "flash_attention_2"
    with pytest.raises(CoSpecError, match="flash_attention_2"):
        make_arbiter(drafter=drafter)
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    with pytest.raises(CoSpecError, match="flash_attention_2"):
        attention_mask_for(mask, "flash_attention_2", torch.float32)


def test_inconsistent_inputs_are_refused(make_arbiter, tokenizer):
    arbiter = make_arbiter()
    vocab = len(tokenizer)
    context = tokens(vocab, 1, 5, seed=0)
    wrong_k = tokens(vocab, 1, K + 1, seed=1)
    with pytest.raises(CoSpecError, match=f"K={K}"):
        arbiter.score_round(
            context, torch.ones(1, 5), torch.arange(5)[None], None, wrong_k, wrong_k
        )
    beyond = ArbitratedRound(6, tokens(vocab, K, seed=2), tokens(vocab, K, seed=3))
    with pytest.raises(CoSpecError, match="context length 6"):
        pack_rollouts([(context[0], [beyond])], K)
    with pytest.raises(CoSpecError, match="head layout"):
        ArbiterConfig(BASE_ID, K, head_layout="product")
