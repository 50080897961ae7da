"""A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library.

A ``tokenizer_config.json`` beside the file is read as Hugging Face and torchtitan read it:
its special tokens (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``, ``sep_token``,
``cls_token``, ``mask_token``, then each of ``added_tokens_decoder``) are added to the
tokenizer, so a name the vocabulary lacks is appended after its last id (torchtitan's test
tokenizer names ``<|begin_of_text|>`` there, which its ``tokenizer.json`` has not); BOS and
EOS are its ``bos_token`` / ``eos_token``. Without one, BOS and EOS are the first known name
the vocabulary contains.
"""

from __future__ import annotations

import json
import os

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer

from titan_train.tokenizer.base import TokenizerError

__all__ = ["HuggingFaceTokenizer"]

_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[SEP]")
_SPECIAL_KEYS = tuple(
    f"{name}_token" for name in ("bos", "eos", "pad", "unk", "sep", "cls", "mask")
)


def _config_token(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # {"content": "<s>", ...} in older files
        value = value.get("content")
    return value if isinstance(value, str) else None


def _added_token(content: str, entry: object) -> AddedToken:
    """A special token as the config describes it (its flags where it gives them)."""
    if not isinstance(entry, dict):  # a bare name
        return AddedToken(content, special=True, normalized=False)
    return AddedToken(
        content,
        single_word=bool(entry.get("single_word", False)),
        lstrip=bool(entry.get("lstrip", False)),
        rstrip=bool(entry.get("rstrip", False)),
        normalized=bool(entry.get("normalized", True)),
        special=bool(entry.get("special", True)),
    )


def _config_special_tokens(config: dict) -> list[AddedToken]:
    """The special tokens ``tokenizer_config.json`` names, in the order torchtitan adds them
    (so a token the vocabulary lacks gets the same id as there)."""
    tokens = []
    for key in _SPECIAL_KEYS:
        name = _config_token(config, key)
        if name is not None:
            tokens.append(_added_token(name, config[key]))
    decoder = config.get("added_tokens_decoder")
    for entry in (decoder or {}).values() if isinstance(decoder, dict) else ():
        if isinstance(entry, dict) and isinstance(entry.get("content"), str):
            tokens.append(_added_token(entry["content"], entry))
    return tokens


class HuggingFaceTokenizer:
    """A ``tokenizer.json`` file; ``encode`` adds no special tokens besides the BOS/EOS asked.
    ``bos_token``/``eos_token`` default to ``tokenizer_config.json``'s, else a known name."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self.path = os.fspath(path)
        try:
            self._tokenizer = _HFTokenizer.from_file(self.path)
        except Exception as e:  # the Rust side raises a bare Exception
            raise TokenizerError(f"cannot read {self.path!r} as a tokenizer.json: {e}") from e
        config: dict = {}
        self._config_path = os.path.join(os.path.dirname(self.path), "tokenizer_config.json")
        if os.path.isfile(self._config_path):
            try:
                with open(self._config_path, encoding="utf-8") as f:
                    config = json.load(f)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise TokenizerError(f"{self._config_path} is not valid JSON: {e}") from e
            if not isinstance(config, dict):
                raise TokenizerError(f"{self._config_path} is not a JSON object.")
            special = _config_special_tokens(config)
            if special:  # already known ones keep their ids; the others are appended
                self._tokenizer.add_special_tokens(special)
        self.bos_id = self._find(bos_token or _config_token(config, "bos_token"), _BOS_NAMES)
        """Id of the beginning-of-text token."""
        self.eos_id = self._find(eos_token or _config_token(config, "eos_token"), _EOS_NAMES)
        """Id of the end-of-text token."""
        self._untrimmed: _HFTokenizer | None = None  # made by encode_with_offsets

    def _find(self, name: str | None, fallbacks: tuple[str, ...]) -> int:
        for candidate in (name,) if name else fallbacks:
            token_id = self._tokenizer.token_to_id(candidate)
            if token_id is not None:
                return token_id
        wanted = repr(name) if name else f"any of {', '.join(fallbacks)}"
        raise TokenizerError(
            f"{self.path} has no token {wanted}. Name its beginning- and end-of-text tokens in "
            f'{self._config_path} ({{"bos_token": "...", "eos_token": "..."}}, as '
            "Hugging Face writes it); a name its vocabulary lacks is then added to it."
        )

    @property
    def vocab_size(self) -> int:
        """Vocabulary size, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of ``text`` without the file's post-processor; then BOS/EOS if asked."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """Ids of ``text`` with special-token names read as the special tokens, and where
        each token starts (from before the post-processor, whose trimming moves them)."""
        if self._untrimmed is None:
            self._untrimmed = _HFTokenizer.from_str(self._tokenizer.to_str())
            self._untrimmed.post_processor = None
        encoding = self._untrimmed.encode(text, add_special_tokens=False)
        return encoding.ids, [start for start, _ in encoding.offsets]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens kept."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer({self.path!r}, vocab_size={self.vocab_size})"
