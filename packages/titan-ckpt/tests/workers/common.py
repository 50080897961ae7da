"""Shared pieces of the torchrun worker scripts: a tiny model, data, and result output.

Imported by the scripts in this folder (a script's own folder is first on sys.path) and by
the tests (through ``load_common`` in conftest.py), so both sides build the same model.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

EVAL_SEED = 1234


def make_model(seed: int = 0) -> nn.Sequential:
    """Three small Linear layers; the same weights on every rank for the same seed."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def shard(model: nn.Sequential) -> nn.Sequential:
    """FSDP2 over the current process group: each Linear, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int) -> None:
    for step in steps:
        x, y = batch(1000 * step + rank)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()


@torch.no_grad()
def eval_loss(model: nn.Module) -> float:
    """Loss on a fixed batch, the same on every rank."""
    x, y = batch(EVAL_SEED)
    return float(nn.functional.mse_loss(model(x), y))


def full_params(model: nn.Module) -> dict[str, list[float]]:
    """Every parameter as a full (unsharded) flat list, for comparing layouts."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().flatten().tolist()
    return out


class TrainState:
    """The step counter, as a Stateful."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step = int(sd["step"])


class DataPosition:
    """A dataloader's position as a Stateful; ``supports_resharding`` and ``dp_degree`` (when
    given: how many ways it shards the data) as the manager reads them."""

    def __init__(self, supports_resharding: bool = True, dp_degree: int | None = None) -> None:
        self.position = 0
        self.supports_resharding = supports_resharding
        if dp_degree is not None:
            self.dp_degree = dp_degree

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.position = int(sd["position"])


def init() -> int:
    """Start gloo from torchrun's environment; returns the rank."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return dist.get_rank()


def finish() -> None:
    """End a worker that succeeded: free what holds gloo work, destroy the process group, and
    leave without interpreter teardown.

    Why: with torch 2.13, a gloo group still referenced (by FSDP state, a device mesh) is freed
    during interpreter finalization, and now and then that aborts the process ("terminate
    called without an active exception", exit -6) after all its work is done; see
    pytorch/pytorch#179291. ``os._exit`` skips that teardown; what the test reads was written
    and flushed before.
    """
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write_result(name: str, payload: dict) -> None:
    """Write ``payload`` as JSON to ``<out_dir>/<name>-rank<r>.json`` (out_dir = argv[1])."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(sys.argv[1], f"{name}-rank{rank}.json")
    with open(path, "w") as f:
        json.dump(payload, f)


class StreamingRenamingAdapter:
    """Native "0.weight" <-> HF "model.layers.0.weight", in the streaming form of titan-ckpt's
    adapter protocol (``to_hf_items``/``from_hf_items``) and the whole-dict one."""

    def to_hf_items(self, items):
        for key, value in items:
            yield f"model.layers.{key}", value

    def from_hf_items(self, items):
        for key, value in items:
            yield key.removeprefix("model.layers."), value

    def to_hf(self, state_dict):
        return dict(self.to_hf_items(state_dict.items()))

    def from_hf(self, hf_state_dict):
        return dict(self.from_hf_items(hf_state_dict.items()))

    def hf_config(self) -> dict:
        return {"architectures": ["TinyMLP"], "hidden_size": 32}


def llama3_args():
    """A tiny titan Llama 3 (dim 64, 2 layers, 4 heads, 2 KV heads, vocab 256); needs
    titan-models."""
    from titan_models.llama3 import Llama3Args

    return Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32)


def make_llama3(seed: int = 0) -> nn.Module:
    """The tiny Llama 3 with initial weights from ``seed``, the same on every rank."""
    from titan_models.llama3 import Llama3

    torch.manual_seed(seed)
    model = Llama3(llama3_args())
    model.init_weights()
    return model
