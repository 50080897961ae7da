"""A model plugin for the tests: Llama 3 in the tiny shape torchtitan recorded (``data/``).

Registered under the ``titan.models`` entry-point group by a ``dist-info`` folder the tests
write, so titan-train finds it as it finds any installed model package. torchtitan's Llama 3
of July 2025 used plain RoPE: ``rope_scaling=None``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from titan_models.llama3 import Llama3Args
from titan_models.llama3.adapter import Llama3StateDictAdapter
from titan_models.llama3.spec import LLAMA3

FLAVORS = {
    "tiny": Llama3Args(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        multiple_of=32,
        vocab_size=2048,
        rope_theta=500000.0,
        rope_scaling=None,
        max_seq_len=32,
    )
}


def args_fn(flavor: str, **overrides: Any) -> Llama3Args:
    return dataclasses.replace(FLAVORS[flavor], **overrides)


def adapter(*, flavor: str | None = None, hf_config: Any = None) -> Llama3StateDictAdapter:
    return Llama3StateDictAdapter(FLAVORS[flavor or "tiny"])


SPEC = dataclasses.replace(
    LLAMA3, name="tt-tiny", flavors=FLAVORS, args_fn=args_fn, state_dict_adapter=adapter
)
