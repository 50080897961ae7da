"""``load_tokenizer``: pick the tokenizer class by file, or the small one titan-train ships."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from titan_train.tokenizer.base import Tokenizer, TokenizerError
from titan_train.tokenizer.hf import HuggingFaceTokenizer
from titan_train.tokenizer.tiktoken_bpe import TiktokenTokenizer, llama3_special_tokens

__all__ = [
    "CHAT_TOKENIZER",
    "DEFAULT_NUM_SPECIAL_TOKENS",
    "chat_tokenizer_path",
    "default_tokenizer_path",
    "load_tokenizer",
]

CHAT_TOKENIZER = "embedded_chat"
"""The ``model.tokenizer_path`` that selects the shipped chat tokenizer folder."""

DEFAULT_NUM_SPECIAL_TOKENS = 8
"""Special tokens of the shipped tokenizer: Llama 3's first 8 (BOS, EOS, 4 reserved, the two
header ids), so its 2,040 ranks make a 2,048-token vocabulary."""


def default_tokenizer_path() -> Path:
    """The shipped BPE file: trained on the embedded corpus by ``tools/train_tokenizer.py``."""
    return Path(str(resources.files("titan_train") / "assets" / "tokenizer.model"))


def chat_tokenizer_path() -> Path:
    """The shipped chat tokenizer folder: the shipped BPE with chat special tokens in its
    2,048 ids, and the built-in ``llama3`` chat template (``tools/make_chat_sample.py``)."""
    return Path(str(resources.files("titan_train") / "assets" / "chat_tokenizer"))


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Tokenizer:
    """The tokenizer at ``path``.

    - ``None``, ``""`` or ``"embedded"``: the shipped 2,048-token tokenizer.
    - ``"embedded_chat"``: the shipped chat tokenizer folder (``chat_tokenizer_path``).
    - a ``.json`` file, or a folder holding ``tokenizer.json``: a Hugging Face tokenizer.
    - any other file, or a folder holding ``tokenizer.model`` (also under ``original/``, as in
      Llama 3 downloads): a tiktoken BPE file with Llama 3's 256 special tokens.
    """
    if path is None or os.fspath(path) in ("", "embedded"):
        return TiktokenTokenizer(
            default_tokenizer_path(),
            special_tokens=llama3_special_tokens(DEFAULT_NUM_SPECIAL_TOKENS),
        )
    if os.fspath(path) == CHAT_TOKENIZER:
        return load_tokenizer(chat_tokenizer_path())
    p = Path(path)
    if p.is_dir():
        for candidate in ("tokenizer.json", "tokenizer.model", "original/tokenizer.model"):
            if (p / candidate).is_file():
                return load_tokenizer(p / candidate)
        raise TokenizerError(
            f"folder {os.fspath(p)!r} holds no tokenizer.json, tokenizer.model or "
            "original/tokenizer.model."
        )
    if not p.is_file():
        raise TokenizerError(
            f"tokenizer file {os.fspath(p)!r} does not exist; give a tiktoken BPE file, a "
            "tokenizer.json, a folder holding one, or leave it empty for the shipped tokenizer."
        )
    if p.suffix == ".json":
        return HuggingFaceTokenizer(p)
    if p.resolve() == default_tokenizer_path().resolve():
        return load_tokenizer(None)
    return TiktokenTokenizer(p)
