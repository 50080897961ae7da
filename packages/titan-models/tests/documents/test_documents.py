"""Document masking: ids and positions of packed windows, and the reference: with positions
restarting, a packed window's logits equal each of its documents run alone (fp32)."""

from __future__ import annotations

import pytest
import torch

from titan_models import documents
from titan_models.deepseek_v3 import DeepSeekV3, deepseek_v3_args
from titan_models.llama3 import Llama3, llama3_args
from titan_models.qwen3 import Qwen3, qwen3_args

EOS = 0


def test_document_ids_end_after_each_eos() -> None:
    tokens = torch.tensor([[5, 6, 0, 7, 0, 0, 8, 9], [0, 1, 2, 3, 4, 5, 6, 0]])
    ids = documents.document_ids(tokens, EOS)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert documents.document_positions(ids).tolist() == [
        [0, 1, 2, 0, 1, 0, 0, 1],
        [0, 0, 1, 2, 3, 4, 5, 6],
    ]


def test_document_masking_kwargs_follow_the_positions_option() -> None:
    tokens = torch.tensor([[5, 0, 7, 8]])
    restart = documents.DocumentMasking(EOS).forward_kwargs(tokens)
    assert restart["document_ids"].tolist() == [[0, 0, 1, 1]]
    assert restart["positions"].tolist() == [[0, 1, 0, 1]]
    assert set(documents.DocumentMasking(EOS, restart_positions=False).forward_kwargs(tokens)) == {
        "document_ids"
    }


def test_the_cpu_takes_the_exact_sdpa_mask() -> None:
    assert not documents.flex_attention_supported("cpu")
    mask = documents.document_mask(torch.tensor([[0, 0, 1]]))
    assert mask.dtype == torch.bool
    assert mask[0, 0].tolist() == [[True, False, False], [True, True, False], [False, False, True]]


def _llama():
    return Llama3(llama3_args("debugmodel", dim=64, n_layers=2, n_heads=4, n_kv_heads=2))


def _qwen():
    return Qwen3(qwen3_args("debugmodel", dim=64, n_layers=2, n_heads=4, n_kv_heads=2))


def _deepseek():
    # MLA with a low-rank query and YaRN; one dense and one MoE block.
    args = deepseek_v3_args(
        "debugmodel",
        vocab_size=2048,
        dim=64,
        n_layers=2,
        n_heads=4,
        kv_lora_rank=32,
        q_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        inter_dim=128,
        moe_inter_dim=32,
    )
    return DeepSeekV3(args)


def _packed_window(vocab: int, lengths: list[int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    docs = []
    for length in lengths:
        doc = torch.randint(1, vocab, (length,), generator=generator)
        doc[-1] = EOS
        docs.append(doc)
    return torch.cat(docs)


@pytest.mark.parametrize("build", [_llama, _qwen, _deepseek], ids=["llama3", "qwen3", "dsv3"])
def test_packed_logits_equal_each_document_alone(build) -> None:
    torch.manual_seed(0)
    model = build()
    model.init_weights()
    model.eval()
    vocab = model.args.vocab_size
    # Two rows, documents of unequal length; the last one of each row is cut by the window.
    rows = [[5, 9, 3, 7], [12, 1, 11]]
    windows = [_packed_window(vocab, lengths, seed) for seed, lengths in enumerate(rows)]
    windows[0][-1] = 3  # the cut document has no EOS
    tokens = torch.stack(windows)
    masking = documents.DocumentMasking(EOS)
    with torch.no_grad():
        packed = model(tokens, **masking.forward_kwargs(tokens))
        plain = model(tokens)
        for row, lengths in enumerate(rows):
            start = 0
            for length in lengths:
                alone = model(tokens[row : row + 1, start : start + length])
                torch.testing.assert_close(
                    packed[row, start : start + length], alone[0], rtol=0, atol=1e-5
                )
                start += length
    # Without masking, later documents see earlier ones: the reference can fail.
    assert not torch.allclose(packed[:, 5:], plain[:, 5:], atol=1e-3)


def test_masking_off_is_the_plain_path() -> None:
    torch.manual_seed(0)
    model = _llama()
    model.init_weights()
    tokens = torch.randint(1, 100, (2, 16))
    with torch.no_grad():
        plain = model(tokens)
        # One document per row and positions 0..seq-1: the masked path computes the same.
        ids = torch.zeros_like(tokens)
        masked = model(tokens, document_ids=ids, positions=documents.document_positions(ids))
    torch.testing.assert_close(masked, plain, rtol=0, atol=1e-5)


def test_a_kv_cache_refuses_document_masking() -> None:
    from titan_models.kv_cache import KVCache

    model = _llama()
    model.init_weights()
    cache = KVCache(model.args.n_layers, 1, 8)
    with pytest.raises(ValueError, match="KV cache"):
        model(torch.tensor([[1, 2]]), cache, document_ids=torch.zeros(1, 2, dtype=torch.int32))


def test_positions_rotate_by_the_given_rows() -> None:
    # RoPE depends only on position differences, so within one masked document restarting
    # and continuing positions agree; without the mask, restarted positions change what a
    # later token sees of the earlier document, and only there.
    torch.manual_seed(0)
    model = _qwen()
    model.init_weights()
    tokens = torch.randint(1, 100, (1, 12))
    tokens[0, 4] = EOS
    positions = documents.document_positions(documents.document_ids(tokens, EOS))
    with torch.no_grad():
        plain = model(tokens)
        restarted = model(tokens, positions=positions)
    torch.testing.assert_close(restarted[:, :5], plain[:, :5], rtol=0, atol=1e-5)
    assert not torch.allclose(restarted[:, 5:], plain[:, 5:], atol=1e-3)
    rope, mask = documents.document_inputs(model.rope, None, positions)
    assert mask is None
    assert torch.equal(rope[0, 7], model.rope[2])


LAYOUTS = ["fsdp_ac", "fsdp_ac_op", "tp", "pp_1f1b"]


@pytest.fixture(scope="module")
def two_rank_losses(tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("docmask")
    return run_torchrun("document_masking.py", 2, out, *LAYOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_rank_layout_with_masking_matches_one_process(layout, two_rank_losses) -> None:
    n_layers = 4 if layout.startswith("pp") else 2
    expected = two_rank_losses[f"single{n_layers}"]
    torch.testing.assert_close(two_rank_losses[layout], expected, rtol=1e-4, atol=1e-5)
    # The masking reached every stage: the unmasked run's losses differ.
    unmasked = two_rank_losses[f"single{n_layers}_unmasked"]
    assert max(abs(a - b) for a, b in zip(unmasked, expected, strict=True)) > 1e-3, (
        unmasked,
        expected,
    )
