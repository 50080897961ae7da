"""The tiny model, data and training loop that the distributed tests and their single-process
reference share. Imported by the worker scripts (by path) and by conftest.py."""

from __future__ import annotations

import torch
from torch.nn import functional

from titan_models.llama3 import Llama3, Llama3Args, RopeScaling

BATCH = 4
SEQ = 32
STEPS = 3
LR = 3e-3

COUNTING_BACKEND = "titan_tests_counting_inductor"
"""A ``torch.compile`` backend name: inductor, counting into ``COMPILED``."""
COMPILED = {"graphs": 0, "calls": 0}
"""Graphs the counting backend compiled, and calls of the compiled code (one per forward of
a compiled module) since this module was loaded."""


def tiny_args(n_layers: int = 2) -> Llama3Args:
    """dim 64, n_layers blocks (2; 4 for pipeline tests), 4 query / 2 key-value heads,
    vocab 256; RoPE scaling active
    (original context 16 < SEQ) so the scaled path is exercised."""
    return Llama3Args(
        dim=64,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=256,
        max_seq_len=SEQ,
        rope_scaling=RopeScaling(original_max_position_embeddings=16),
    )


def reference_state_dict(n_layers: int = 2) -> dict[str, torch.Tensor]:
    """The same initial weights on every rank and in every test."""
    torch.manual_seed(0)
    model = Llama3(tiny_args(n_layers))
    model.init_weights()
    return model.state_dict()


def batches() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels, shape (STEPS, BATCH, SEQ)."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (STEPS, BATCH, SEQ + 1), generator=generator)
    return tokens[..., :-1], tokens[..., 1:]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def train_single_process(n_layers: int = 2) -> list[float]:
    """Per-step losses of plain single-process training on the full batch."""
    model = Llama3(tiny_args(n_layers))
    model.load_state_dict(reference_state_dict(n_layers))
    return train_steps(model)


def train_steps(model: torch.nn.Module) -> list[float]:
    """Per-step losses of training ``model`` (already holding its weights) in one process."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    inputs, labels = batches()
    losses = []
    for step in range(STEPS):
        loss = cross_entropy(model(inputs[step]), labels[step])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def register_counting_backend() -> str:
    """Register ``COUNTING_BACKEND`` (once per process) and return its name: inductor, with
    every graph it compiles and every call of compiled code counted in ``COMPILED``."""
    from torch._dynamo import list_backends, register_backend
    from torch._inductor.compile_fx import compile_fx

    if COUNTING_BACKEND in list_backends(exclude_tags=()):
        return COUNTING_BACKEND

    def counting_inductor(graph, example_inputs):
        compiled = compile_fx(graph, example_inputs)
        COMPILED["graphs"] += 1

        def run(*args):
            COMPILED["calls"] += 1
            return compiled(*args)

        # Inductor's code may take its inputs as one list ("boxed") so it can free them
        # early; keep that calling convention.
        run._boxed_call = getattr(compiled, "_boxed_call", False)
        return run

    register_backend(counting_inductor, name=COUNTING_BACKEND)
    return COUNTING_BACKEND


def expert_shapes(parts: list[torch.nn.Module]) -> dict[str, list[int]]:
    """This rank's local shape of every expert weight (routed and shared) of ``parts``, by
    parameter name: how a parallel plan split them."""
    shapes = {}
    for part in parts:
        for name, param in part.named_parameters():
            if ".experts." in name or ".shared_expert." in name:
                local = param.to_local() if hasattr(param, "to_local") else param
                shapes[name] = list(local.shape)
    return shapes
