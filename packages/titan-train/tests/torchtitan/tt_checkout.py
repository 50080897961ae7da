"""A torchtitan-shaped checkout, built by the tests: what torchtitan's July 2025 debug TOML
(``../torchtitan_configs/debug_model.toml``) finds relative to the working directory.

- ``tests/assets/tokenizer``: a byte-level BPE ``tokenizer.json`` of 1,998 tokens with no
  special token, and a ``tokenizer_config.json`` naming ``<|begin_of_text|>`` and
  ``<|end_of_text|>`` as BOS/EOS (also in its ``added_tokens_decoder``, at ids 128000 and
  128001): the shape of torchtitan's test tokenizer, whose vocabulary lacks both names.
- ``tests/assets/c4_test``: JSON lines with ``text``, ``timestamp`` and ``url``, as C4's.

The text is titan's embedded corpus, so nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from titan_train.data.embedded import embedded_documents

CONFIGS = Path(__file__).parent.parent / "torchtitan_configs"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
VOCAB = 1998
"""The tokenizer.json's own vocabulary; torchtitan appends BOS and EOS: 2,000 in all."""


def write_tokenizer(folder: Path) -> Path:
    """torchtitan's test tokenizer's shape in ``folder``; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(embedded_documents()[:20], trainer=trainer)
    assert tok.get_vocab_size() == VOCAB
    assert tok.token_to_id(BOS) is None
    tok.save(str(folder / "tokenizer.json"))
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    config = {
        "added_tokens_decoder": {
            "128000": {"content": BOS, **entry, "special": True},
            "128001": {"content": EOS, **entry, "special": True},
        },
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


def write_c4_test(folder: Path, documents: int = 64) -> Path:
    """A small C4-like ``data.json`` (JSON lines) in ``folder``; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = [d for d in embedded_documents() if d.strip()][:documents]
    with open(folder / "data.json", "w", encoding="utf-8") as f:
        for i, text in enumerate(docs):
            row = {"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": f"doc{i}"}
            f.write(json.dumps(row) + "\n")
    return folder


def write_checkout(root: Path, toml: str = "debug_model.toml") -> Path:
    """A working directory as torchtitan's repository root: the assets above and the
    unedited TOML at ``torchtitan/models/llama3/train_configs/<toml>``; returns its path."""
    write_tokenizer(root / "tests" / "assets" / "tokenizer")
    write_c4_test(root / "tests" / "assets" / "c4_test")
    configs = root / "torchtitan" / "models" / "llama3" / "train_configs"
    configs.mkdir(parents=True)
    shutil.copy(CONFIGS / toml, configs / toml)
    return configs / toml
