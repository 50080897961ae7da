"""Load balance across experts: the auxiliary-loss-free bias update and the load metrics.

After each optimizer step a trainer calls ``expert_load(model_parts, group)`` (per MoE layer,
the least and most loaded expert's share of tokens and the normalized entropy, for metrics),
then ``update_expert_bias(model_parts, group)`` (all-reduce the counts over ``group``, nudge
each expert's selection bias toward balance, zero the counts): in that order, since the update
zeroes what the metrics read.

``group``: the data- and context-parallel ranks, which see different tokens of the same
layers (a ``ProcessGroup``, a 1-D ``DeviceMesh``, or ``None`` for the default group; under
pipeline parallel pass ``dp_cp``). All its ranks call together."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_models.init import parameter_name
from titan_models.moe.layer import MoE

__all__ = ["ExpertBalancer", "expert_load", "moe_layers", "update_expert_bias"]

Group = dist.ProcessGroup | DeviceMesh | None


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every ``MoE`` in ``model`` (itself included) with its FQN, in module order; the FQN
    leaves out the wrappers that activation checkpointing and compile insert."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            found.append((parameter_name(name), module))
    return found


def _all_layers(model_parts: nn.Module | Iterable[nn.Module]) -> list[tuple[str, MoE]]:
    parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
    return [layer for part in parts for layer in moe_layers(part)]


def _process_group(group: Group) -> dist.ProcessGroup | None:
    """The group to all-reduce over, or ``None`` when there is nothing to reduce with."""
    if isinstance(group, DeviceMesh):
        return group.get_group()
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def _summed_counts(layers: list[MoE], group: Group) -> torch.Tensor:
    """The layers' ``tokens_per_expert`` stacked (layers, experts), summed over ``group`` in
    one all-reduce."""
    counts = torch.stack([layer.tokens_per_expert for layer in layers])
    process_group = _process_group(group)
    if process_group is not None and dist.get_world_size(process_group) > 1:
        dist.all_reduce(counts, group=process_group)
    return counts


@torch.no_grad()
def update_expert_bias(model_parts: nn.Module | Iterable[nn.Module], group: Group = None) -> None:
    """The auxiliary-loss-free load-balancing step (DeepSeek-V3) for every MoE layer: with
    ``load_balance_coeff`` c and counts n summed over ``group``, ``c * sign(mean(n) - n)``,
    centered to mean 0, is added to ``expert_bias`` (underloaded experts become likelier), then
    the counts are zeroed. A model without MoE layers is left alone (no communication)."""
    layers = [layer for _, layer in _all_layers(model_parts)]
    biased = [layer for layer in layers if layer.expert_bias is not None]
    if biased:
        _nudge_bias(biased, _summed_counts(biased, group))
    for layer in layers:
        layer.tokens_per_expert.zero_()


def _nudge_bias(layers: list[MoE], counts: torch.Tensor) -> None:
    for layer, layer_counts in zip(layers, counts, strict=True):
        if layer.expert_bias is None:
            continue
        # sign(mean(n) - n), in integers: exact whatever the counts.
        below_mean = layer_counts.sum() - layer_counts.numel() * layer_counts
        delta = layer.load_balance_coeff * torch.sign(below_mean).to(layer.expert_bias.dtype)
        layer.expert_bias.add_(delta - delta.mean())


@torch.no_grad()
def expert_load(
    model_parts: nn.Module | Iterable[nn.Module], group: Group = None
) -> dict[str, float]:
    """Per MoE layer, from the tokens counted since the last ``update_expert_bias`` (summed
    over ``group``): ``moe/<layer>/min_share`` and ``moe/<layer>/max_share`` (fractions of
    the layer's routed tokens that its least and most loaded expert received; 1/E each when
    balanced) and ``moe/<layer>/entropy`` (entropy of the shares over log E: 1 balanced, 0
    all on one expert). ``<layer>`` is the layer's FQN without a trailing ``.moe``
    (``layers.1``). Layers that counted no tokens are left out. Call it before
    ``update_expert_bias``, which zeroes the counts."""
    named = _all_layers(model_parts)
    if not named:
        return {}
    counts = _summed_counts([layer for _, layer in named], group)
    return _load_metrics([name for name, _ in named], counts)


def _load_metrics(names: list[str], counts: torch.Tensor) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for name, layer_counts in zip(names, counts, strict=True):
        total = layer_counts.sum()
        if total <= 0:
            continue
        shares = layer_counts.double() / total
        entropy = -(shares * shares.clamp_min(1e-300).log()).sum().item()
        num_experts = shares.numel()
        layer_name = "" if name == "moe" else name.removesuffix(".moe")
        prefix = "/".join(filter(None, ("moe", layer_name)))
        metrics[f"{prefix}/min_share"] = shares.min().item()
        metrics[f"{prefix}/max_share"] = shares.max().item()
        metrics[f"{prefix}/entropy"] = entropy / math.log(num_experts) if num_experts > 1 else 1.0
    return metrics


class ExpertBalancer:
    """What a trainer runs after each optimizer step for the MoE layers of ``model_parts``: one
    all-reduce of the token counts over ``group``, :func:`update_expert_bias` on them, and the
    counts kept for :meth:`metrics` (the last step's load, read at reporting steps, after the
    update zeroed the live counts). No host sync until :meth:`metrics`. Unlike the functions
    above, ``group=None`` means no reduction; pass the data- and context-parallel group
    (``parallel_dims.get_mesh("dp_cp")``) when ranks see different tokens."""

    def __init__(
        self,
        model_parts: nn.Module | Iterable[nn.Module],
        group: dist.ProcessGroup | DeviceMesh | None,
    ) -> None:
        named = _all_layers(model_parts)
        self.names = [name for name, _ in named]
        self.layers = [layer for _, layer in named]
        self.group = group
        self.last_counts: torch.Tensor | None = None

    @torch.no_grad()
    def __call__(self) -> None:
        """Reduce the counts, nudge the biases, keep the counts, zero the live ones."""
        if not self.layers:
            return
        counts = torch.stack([layer.tokens_per_expert for layer in self.layers])
        if self.group is not None:
            process_group = _process_group(self.group)
            if process_group is not None and dist.get_world_size(process_group) > 1:
                dist.all_reduce(counts, group=process_group)
        _nudge_bias(self.layers, counts)
        self.last_counts = counts
        for layer in self.layers:
            layer.tokens_per_expert.zero_()

    def replica_summed_buffers(self) -> list[torch.Tensor]:
        """The live token counts, which a trainer with torchft replica groups sums over the
        groups before each commit: then every group nudges its biases by the same totals
        (each group's own counts would let their routing drift apart)."""
        return [layer.tokens_per_expert for layer in self.layers]

    def metrics(self) -> dict[str, float]:
        """``expert_load``'s numbers for the tokens of the last step (empty before one)."""
        if self.last_counts is None:
            return {}
        return _load_metrics(self.names, self.last_counts)
