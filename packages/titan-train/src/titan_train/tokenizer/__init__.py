"""Tokenizers: tiktoken BPE files (Llama 3 format) and Hugging Face ``tokenizer.json``;
titan-train ships a 2,048-token tiktoken file as its default (``tools/train_tokenizer.py``
in the repository makes it).

``load_tokenizer(path)`` picks the right class; ``load_tokenizer()`` is the shipped one.
"""

from titan_train.tokenizer.base import Tokenizer, TokenizerError
from titan_train.tokenizer.hf import HuggingFaceTokenizer
from titan_train.tokenizer.load import (
    CHAT_TOKENIZER,
    DEFAULT_NUM_SPECIAL_TOKENS,
    chat_tokenizer_path,
    default_tokenizer_path,
    load_tokenizer,
)
from titan_train.tokenizer.tiktoken_bpe import (
    LLAMA3_PATTERN,
    TiktokenTokenizer,
    llama3_special_tokens,
    read_tiktoken_bpe,
    write_tiktoken_bpe,
)

__all__ = [
    "CHAT_TOKENIZER",
    "DEFAULT_NUM_SPECIAL_TOKENS",
    "LLAMA3_PATTERN",
    "HuggingFaceTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerError",
    "chat_tokenizer_path",
    "default_tokenizer_path",
    "llama3_special_tokens",
    "load_tokenizer",
    "read_tiktoken_bpe",
    "write_tiktoken_bpe",
]
