"""``titan_models.kv_cache.KVCache`` through Llama 3's (and DeepSeek-V3's, Qwen3's) forward, checked
against the model's own full forward without a cache: incremental decoding, left-padded
rows and padding slots in the middle give each real token the logits of the uncached model
on that row alone."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from titan_models import ModelConfigError
from titan_models.deepseek_v3 import DeepSeekV3, deepseek_v3_args
from titan_models.kv_cache import KVCache
from titan_models.llama3 import Llama3, llama3_args

VOCAB = 97


@pytest.fixture(scope="module")
def model() -> Llama3:
    torch.manual_seed(0)
    args = llama3_args(
        "debugmodel", vocab_size=VOCAB, max_seq_len=64, n_layers=2, dim=64, n_heads=4,
        n_kv_heads=2,
    )  # fmt: skip
    model = Llama3(args)
    model.init_weights()
    return model.eval()


def tokens(rows: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_prefill_then_one_token_at_a_time_equals_the_full_forward(model):
    t = tokens(2, 12)
    full = model(t)
    cache = KVCache(2, 2, 12)
    steps = [model(t[:, :5], cache=cache)]
    steps += [model(t[:, i : i + 1], cache=cache) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.start == 12


@torch.no_grad()
def test_left_padded_rows_get_the_logits_of_each_row_alone(model):
    lengths = [3, 9, 6]
    rows = [tokens(1, n, seed=i)[0] for i, n in enumerate(lengths)]
    longest = max(lengths)
    batch = torch.stack(
        [torch.cat((torch.full((longest - n,), 7), r)) for n, r in zip(lengths, rows, strict=True)]
    )
    padding = torch.arange(longest)[None, :] < torch.tensor([longest - n for n in lengths])[:, None]
    cache = KVCache(2, 3, longest + 4)
    cache.set_padding(padding)
    out = model(batch, cache=cache)
    nxt = tokens(3, 1, seed=9)
    out2 = model(nxt, cache=cache)
    for i, (n, r) in enumerate(zip(lengths, rows, strict=True)):
        alone = model(torch.cat((r, nxt[i]))[None])[0]
        torch.testing.assert_close(out[i, longest - n :], alone[:n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out2[i, 0], alone[n], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()  # padding queries attend to themselves: no NaN


@torch.no_grad()
def test_padding_slots_between_tokens_are_invisible(model):
    """Each new token fed after padding slots (as tensor-parallel generation feeds one token
    in a sequence-parallel-sized chunk) gets the logits of the row without them."""
    t = tokens(1, 7)
    full = model(t)
    cache = KVCache(2, 1, 32)
    model(t[:, :4], cache=cache)
    for i in range(4, 7):
        chunk = torch.tensor([[0, 0, int(t[0, i])]])
        cache.set_padding(torch.tensor([[True, True, False]]))
        out = model(chunk, cache=cache)
        torch.testing.assert_close(out[0, -1], full[0, i], rtol=1e-5, atol=1e-5)
    assert cache.positions(1).tolist() == [[7]]


@torch.no_grad()
@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_cached_greedy_decode_of_grouped_query_heads_equals_uncached(n_kv_heads):
    """Grouped-query attention (4 query heads over 1 or 2 key/value heads): greedy decoding
    through the cache picks the tokens the uncached model picks from the whole sequence."""
    torch.manual_seed(0)
    args = llama3_args(
        "debugmodel", vocab_size=VOCAB, max_seq_len=64, n_layers=2, dim=64, n_heads=4,
        n_kv_heads=n_kv_heads,
    )  # fmt: skip
    gqa = Llama3(args)
    gqa.init_weights()
    gqa.eval()
    prompt, steps = tokens(2, 5, seed=3), 10
    uncached = prompt
    for _ in range(steps):
        nxt = gqa(uncached)[:, -1].argmax(dim=-1, keepdim=True)
        uncached = torch.cat((uncached, nxt), dim=1)
    cache = KVCache(2, 2, 5 + steps)
    cached, logits = prompt, gqa(prompt, cache=cache)
    for _ in range(steps):
        nxt = logits[:, -1].argmax(dim=-1, keepdim=True)
        cached = torch.cat((cached, nxt), dim=1)
        logits = gqa(nxt, cache=cache)
    assert torch.equal(cached, uncached)
    assert cache.layer(0).k.shape == (2, n_kv_heads, 5 + steps, 16)  # grouped heads stored


class _LargestOutput(TorchDispatchMode):
    """The largest number of elements any op's output has (what the ops allocate)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


@torch.no_grad()
def test_decoding_reads_grouped_heads_without_repeating_the_cache():
    """A decode step with 1 key/value head for 4 query heads allocates nothing of the size of
    the cache repeated for every query head (batch x heads x slots x head_dim)."""
    cache = KVCache(1, 2, 256)
    layer = cache.layer(0)
    layer.attend(*(torch.randn(2, h, 200, 16) for h in (4, 1, 1)))
    cache.advance(200)
    with _LargestOutput() as seen:
        out = layer.attend(*(torch.randn(2, h, 1, 16) for h in (4, 1, 1)))
    assert out.shape == (2, 4, 1, 16)
    assert seen.largest < 2 * 4 * 201 * 16


def test_forward_without_a_cache_is_the_training_path(model):
    """No cache: the same bits as before the cache existed (the model's plain forward)."""
    t = tokens(2, 8)
    with torch.no_grad():
        assert torch.equal(model(t), model(t, cache=None))


def test_a_full_cache_and_bad_sizes_are_refused(model):
    cache = KVCache(2, 1, 4)
    with torch.no_grad():
        model(tokens(1, 4), cache=cache)
        with pytest.raises(ModelConfigError, match="holds 4 slots; 4 are filled and 1 more"):
            model(tokens(1, 1), cache=cache)
    with pytest.raises(ModelConfigError, match="max_len >= 1"):
        KVCache(2, 1, 0)
    with pytest.raises(ModelConfigError, match=r"\(batch=2, seq\) mask"):
        KVCache(2, 2, 8).set_padding(torch.zeros(3, 1, dtype=torch.bool))
    with pytest.raises(ModelConfigError, match="exceeds the RoPE table's 64 positions"):
        KVCache(2, 1, 80).rope_rows(model.rope, 70)


@torch.no_grad()
def test_deepseek_v3_takes_the_cache_too():
    """Multi-head latent attention (keys and values of other widths, its own softmax scale):
    left-padded, incremental decoding equals its full forward on each row alone."""
    torch.manual_seed(0)
    model = DeepSeekV3(deepseek_v3_args("debugmodel", vocab_size=VOCAB, max_seq_len=32)).eval()
    model.init_weights()
    t = tokens(2, 9)
    cache = KVCache(model.args.n_layers, 2, 16)
    cache.set_padding(torch.tensor([[True, True] + [False] * 5, [False] * 7]))
    # Row 0: 5 tokens behind 2 padding slots; row 1: 7 tokens.
    rows = torch.stack((torch.cat((torch.zeros(2, dtype=torch.long), t[0, :5])), t[1, :7]))
    first = model(rows, cache=cache)
    nxt = torch.stack((t[0, 5:6], t[1, 7:8]))
    second = model(nxt, cache=cache)
    alone = [model(t[:1, :6])[0], model(t[1:, :8])[0]]
    torch.testing.assert_close(first[0, 2:], alone[0][:5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first[1], alone[1][:7], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second[0, 0], alone[0][5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second[1, 0], alone[1][7], rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_qwen3_takes_the_cache_too(moe):
    """QK-norm and half-split RoPE (per-row angles), dense and MoE blocks: left-padded,
    incremental decoding equals the full forward on each row alone."""
    from titan_models.moe import tokens_not_counted
    from titan_models.qwen3 import Qwen3
    from titan_models.qwen3.args import qwen3_args

    torch.manual_seed(0)
    flavor = "debugmodel_moe" if moe else "debugmodel"
    args = qwen3_args(flavor, vocab_size=VOCAB, max_seq_len=32, n_layers=2, dim=64,
                      n_heads=4, n_kv_heads=2, head_dim=16)  # fmt: skip
    model = Qwen3(args).eval()
    model.init_weights()
    t = tokens(2, 9)
    cache = KVCache(args.n_layers, 2, 16)
    cache.set_padding(torch.tensor([[True, True] + [False] * 5, [False] * 7]))
    rows = torch.stack((torch.cat((torch.zeros(2, dtype=torch.long), t[0, :5])), t[1, :7]))
    with tokens_not_counted():
        first = model(rows, cache=cache)
        second = model(torch.stack((t[0, 5:6], t[1, 7:8])), cache=cache)
        alone = [model(t[:1, :6])[0], model(t[1:, :8])[0]]
    torch.testing.assert_close(first[0, 2:], alone[0][:5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first[1], alone[1][:7], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second[0, 0], alone[0][5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second[1, 0], alone[1][7], rtol=1e-5, atol=1e-5)
