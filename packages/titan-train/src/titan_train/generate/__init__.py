"""Sampling from a model: ``SamplingConfig``, ``sample_next`` and the ``generate`` loop.

With a KV cache (a model whose ``forward`` takes ``cache=``) the prompts are left-padded
into one batch, run once, then each step feeds every row's newest token; without one every
step re-runs each row's whole sequence (slower, same tokens). Temperature 0 is greedy (ties
to the lowest id); otherwise ``top_k`` and ``top_p`` cut the tempered logits and a generator
seeded by ``seed`` draws, so the same seed gives the same tokens.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from titan_models.kv_cache import KVCache
from titan_train.errors import ConfigError, check_bool, check_int, check_number

__all__ = ["SamplingConfig", "generate", "sample_next", "supports_kv_cache"]

logger = logging.getLogger("titan_train")


@dataclass(kw_only=True)
class SamplingConfig:
    """How tokens are picked."""

    max_new_tokens: int = 64
    """Tokens to add to each prompt at most."""
    temperature: float = 1.0
    """Divide the logits by this before sampling; 0 picks the most likely token (greedy)."""
    top_k: int = 0
    """Sample among the k most likely tokens only; 0 keeps all."""
    top_p: float = 1.0
    """Sample among the most likely tokens whose probabilities add up to top_p (nucleus
    sampling); 1 keeps all."""
    seed: int = 0
    """Seed of the sampling generator: the same seed, model and prompts give the same text."""
    kv_cache: bool = True
    """Keep the keys and values of past tokens (fast); off, or for a model without a cache,
    every step re-runs the whole sequence."""
    stop_at_eos: bool = True
    """End a prompt's continuation at the end-of-text token."""

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        check_number("temperature", self.temperature, low=0, hint="0 is greedy")
        check_int("top_k", self.top_k, minimum=0, hint="0 keeps every token")
        check_number("top_p", self.top_p, low=0, high=1, low_open=True, hint="1 keeps all")
        check_int("seed", self.seed, minimum=0)
        check_bool("kv_cache", self.kv_cache)
        check_bool("stop_at_eos", self.stop_at_eos)

    @property
    def greedy(self) -> bool:
        """Temperature 0: the most likely token, no randomness."""
        return self.temperature == 0


def sample_next(
    logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
) -> torch.Tensor:
    """The next token of each row from its logits (rows, vocab): (rows,) int64."""
    logits = logits.float()
    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Drop a token when the ones more likely than it already reach top_p: the most
        # likely token always stays.
        drop = (probs.cumsum(dim=-1) - probs) >= sampling.top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def supports_kv_cache(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes a ``cache`` (``titan_models.kv_cache.KVCache``)."""
    return "cache" in inspect.signature(model.forward).parameters


TokenCallback = Callable[[int, int], None]
"""``on_token(row, token)``: called for every token generated, as soon as it is chosen."""


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    *,
    eos_id: int | None = None,
    vocab_size: int | None = None,
    device: torch.device | str = "cpu",
    on_token: TokenCallback | None = None,
    multiple: int = 1,
) -> list[list[int]]:
    """Each prompt's new tokens (end-of-text included when reached), below ``vocab_size``; under
    TP every rank takes rank 0's; ``multiple`` pads lengths (sequence parallel)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("Every prompt needs at least one token.")
    generator = None
    if not sampling.greedy:
        generator = torch.Generator(device=device)
        generator.manual_seed(sampling.seed)
    model.eval()
    step = _Stepper(sampling, generator, eos_id, vocab_size, on_token, len(prompts))
    cached = supports_kv_cache(model)
    if sampling.kv_cache and not cached:
        logger.warning(
            "%s has no KV cache: every new token re-runs the whole sequence (slower).",
            type(model).__name__,
        )
    if sampling.kv_cache and cached:
        _generate_cached(model, prompts, step, device, multiple)
    elif multiple > 1:
        raise ConfigError(
            f"Feeding sequences in multiples of {multiple} tokens (tensor parallel) needs a "
            "KV cache: turn kv_cache on, with a model that has one."
        )
    else:
        _generate_reforward(model, prompts, step, device)
    return step.outputs


class _Stepper:
    """Picks each step's tokens from the last logits, agrees on them across ranks, and
    keeps every row's output and whether it has ended."""

    def __init__(
        self,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        eos_id: int | None,
        vocab_size: int | None,
        on_token: TokenCallback | None,
        rows: int,
    ) -> None:
        self.sampling, self.generator, self.on_token = sampling, generator, on_token
        self.eos_id = eos_id if sampling.stop_at_eos else None
        self.vocab_size = vocab_size
        self.outputs: list[list[int]] = [[] for _ in range(rows)]
        self.done = [False] * rows
        self._shared = dist.is_initialized() and dist.get_world_size() > 1

    def __call__(self, logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """Choose the next token of ``rows`` (those still running are recorded) from their
        last logits (len(rows), vocab); returns the tokens (len(rows),)."""
        if self.vocab_size is not None and logits.shape[-1] > self.vocab_size:
            logits = logits[..., : self.vocab_size]
        tokens = sample_next(logits, self.sampling, self.generator)
        if self._shared:
            dist.broadcast(tokens, src=0)
        for row, token in zip(rows, tokens.tolist(), strict=True):
            if self.done[row]:
                continue
            self.outputs[row].append(token)
            if self.on_token is not None:
                self.on_token(row, token)
            if token == self.eos_id or len(self.outputs[row]) >= self.sampling.max_new_tokens:
                self.done[row] = True
        return tokens

    @property
    def finished(self) -> bool:
        return all(self.done)


def _generate_cached(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    step: _Stepper,
    device: torch.device | str,
    multiple: int,
) -> None:
    # Every forward's length is a multiple of `multiple` (sequence parallel splits it evenly
    # over the ranks): prompts are left-padded to one, and each new token is fed after
    # multiple - 1 padding slots. Padding slots hold token 0 and are masked (KVCache).
    longest = -(-max(len(p) for p in prompts) // multiple) * multiple
    pad = [longest - len(p) for p in prompts]
    batch = torch.tensor([[0] * n + list(p) for n, p in zip(pad, prompts, strict=True)])
    padding = torch.arange(longest)[None, :] < torch.tensor(pad)[:, None]
    rows = len(prompts)
    cache = KVCache(
        _layer_count(model), rows, longest + step.sampling.max_new_tokens * multiple, device=device
    )
    cache.set_padding(padding)
    tokens = step(model(batch.to(device), cache=cache)[:, -1], range(rows))
    feed = torch.zeros(rows, multiple, dtype=torch.long, device=device)
    feed_padding = torch.ones(rows, multiple, dtype=torch.bool)
    feed_padding[:, -1] = False
    while not step.finished:
        feed[:, -1] = tokens
        cache.set_padding(feed_padding)
        tokens = step(model(feed, cache=cache)[:, -1], range(rows))


def _generate_reforward(
    model: nn.Module, prompts: Sequence[Sequence[int]], step: _Stepper, device
) -> None:
    sequences = [list(p) for p in prompts]
    while not step.finished:
        running = [row for row, done in enumerate(step.done) if not done]
        for row in running:
            logits = model(torch.tensor([sequences[row]], device=device))[:, -1]
            token = int(step(logits, [row])[0])
            sequences[row].append(token)


def _layer_count(model: nn.Module) -> int:
    """Attention layers the cache needs: the model's ``layers`` (indexed by name)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ConfigError(
            f"{type(model).__name__} takes a cache but has no 'layers' to size it by."
        )
    names = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else range(len(layers))
    return max(int(name) for name in names) + 1
