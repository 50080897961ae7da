"""Regenerate titan-train's chat sample and the chat tokenizer folder shipped beside it.

    python tools/make_chat_sample.py            # rewrite both
    python tools/make_chat_sample.py --check    # exit 1 if either is out of date

Writes, under ``packages/titan-train/src/titan_train/assets``:

- ``chat_sample.jsonl``: 400 short synthetic conversations (arithmetic, word reversal,
  opposites, capitals, letter counts; some with a system prompt, some of two or three
  exchanges), one ``{"messages": [...]}`` per line. Drawn from ``random.Random(SEED)``: the
  same file on every run and Python version.
- ``chat_tokenizer/``: a Hugging Face tokenizer folder (``tokenizer.json``,
  ``tokenizer_config.json`` with the built-in ``llama3`` chat template). Its BPE is the
  shipped ``tokenizer.model`` (the same 2,040 ranks, every merge of a rank's two parts
  listed, so it splits text as tiktoken does), and its 8 special tokens fill ids
  2040-2047: ``<|begin_of_text|>``, ``<|end_of_text|>``, ``<|eot_id|>``, ``<|im_start|>``,
  ``<|im_end|>``, a reserved one, ``<|start_header_id|>``, ``<|end_header_id|>``: both
  built-in templates work with it, and a model keeps the shipped 2,048-token vocabulary.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from titan_train.data.chat_template import BUILTIN_TEMPLATES
from titan_train.tokenizer import LLAMA3_PATTERN, default_tokenizer_path, read_tiktoken_bpe

SEED = 2026
CONVERSATIONS = 400
ASSETS = default_tokenizer_path().parent
SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|reserved_special_token_0|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
)

_NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_NUMBERS += ("ten", "eleven", "twelve")
_WORDS = ("table", "garden", "river", "window", "pencil", "orange", "silver", "planet")
_WORDS += ("forest", "candle", "button", "rocket", "mirror", "ladder", "basket", "guitar")
_WORDS += ("kitten", "pepper", "marble", "tunnel")
_OPPOSITES = {
    "hot": "cold",
    "up": "down",
    "big": "small",
    "early": "late",
    "light": "dark",
    "fast": "slow",
    "open": "closed",
    "full": "empty",
    "happy": "sad",
    "old": "new",
}
_CAPITALS = {
    "France": "Paris",
    "Italy": "Rome",
    "Japan": "Tokyo",
    "Egypt": "Cairo",
    "Canada": "Ottawa",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Norway": "Oslo",
    "Spain": "Madrid",
    "India": "New Delhi",
}
_SYSTEMS = (
    "You are a helpful assistant.",
    "You answer in one short sentence.",
    "You are a patient teacher.",
)


def _arithmetic(rng: random.Random) -> list[tuple[str, str]]:
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    turns = [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.")]
    if rng.random() < 0.4:
        c = rng.randint(2, 9)
        turns.append((f"And that times {c}?", f"{a + b} times {c} is {(a + b) * c}."))
    return turns


def _reverse(rng: random.Random) -> list[tuple[str, str]]:
    word = rng.choice(_WORDS)
    return [(f"Spell the word '{word}' backwards.", f"'{word}' backwards is '{word[::-1]}'.")]


def _opposite(rng: random.Random) -> list[tuple[str, str]]:
    turns = []
    for word in rng.sample(sorted(_OPPOSITES), rng.choice((1, 1, 2, 3))):
        answer = f"The opposite of {word} is {_OPPOSITES[word]}."
        turns.append((f"What is the opposite of {word}?", answer))
    return turns


def _capital(rng: random.Random) -> list[tuple[str, str]]:
    country = rng.choice(sorted(_CAPITALS))
    answer = f"The capital of {country} is {_CAPITALS[country]}."
    return [(f"What is the capital of {country}?", answer)]


def _letters(rng: random.Random) -> list[tuple[str, str]]:
    word = rng.choice(_WORDS)
    count = _NUMBERS[len(word)] if len(word) < len(_NUMBERS) else str(len(word))
    return [(f"How many letters are in '{word}'?", f"'{word}' has {count} letters.")]


def conversations() -> list[dict[str, list[dict[str, str]]]]:
    """The sample's conversations, the same for the same ``SEED``."""
    rng = random.Random(SEED)
    tasks = (_arithmetic, _reverse, _opposite, _capital, _letters)
    out = []
    for _ in range(CONVERSATIONS):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(_SYSTEMS)})
        for user, assistant in rng.choice(tasks)(rng):
            messages += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": assistant},
            ]
        out.append({"messages": messages})
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (the one the
    ``ByteLevel`` pre-tokenizer maps it to)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def tokenizer_files() -> dict[str, str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` of the chat tokenizer folder."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    ranks = read_tiktoken_bpe(default_tokenizer_path())
    alphabet = _bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        splits = [
            (ranks[token[:k]], ranks[token[k:]], token[:k], token[k:])
            for k in range(1, len(token))
            if token[:k] in ranks and token[k:] in ranks
        ]
        merges += [(text(a), text(b)) for _, _, a, b in sorted(splits)]
    tokenizer = Tokenizer(BPE(vocab, merges, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    tokenizer.add_special_tokens(specials)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": BUILTIN_TEMPLATES["llama3"],
    }
    return {
        "tokenizer.json": tokenizer.to_str() + "\n",
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
    }


def outputs() -> dict[str, str]:
    """Every file this script writes, by path relative to the assets folder."""
    sample = "".join(json.dumps(c, separators=(",", ":")) + "\n" for c in conversations())
    files = {"chat_sample.jsonl": sample}
    files.update({f"chat_tokenizer/{name}": body for name, body in tokenizer_files().items()})
    return files


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) the sample and the tokenizer folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets", type=Path, default=ASSETS)
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for name, body in outputs().items():
        path = args.assets / name
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != body:
                stale.append(name)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, encoding="utf-8") as f:
            f.write(body)
        Path(f.name).chmod(0o644)
        Path(f.name).replace(path)
        print(f"wrote {path} ({len(body.encode()):,} bytes)")
    if args.check:
        print("OUT OF DATE: " + ", ".join(stale) if stale else "up to date")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
