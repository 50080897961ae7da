"""Chat data (``titan_train.data.chat``) against transformers as the reference: the ids equal
``apply_chat_template`` for the same tokenizer folder and messages (the built-in llama3 and
qwen3 templates, plain ChatML, ChatML with a default system prompt, and a template with
``{% generation %}`` marks, whose assistant mask transformers computes itself), for one turn,
a system prompt and several turns; the trained tokens decode to exactly each assistant turn
with its end token; packing keeps every label its input's successor or ``IGNORE_INDEX``,
across window cuts and a resume; bad templates and rows are refused in one line."""

from __future__ import annotations

import itertools
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from titan_train.data import (
    BUILTIN_TEMPLATES,
    IGNORE_INDEX,
    DataConfig,
    DataError,
    build_chat_encoder,
    build_dataloader,
    load_chat_template,
)
from titan_train.data.chat import check_chat_template
from titan_train.tokenizer import chat_tokenizer_path, load_tokenizer

transformers = pytest.importorskip("transformers")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATES = {
    "llama3": BUILTIN_TEMPLATES["llama3"],
    "qwen3": BUILTIN_TEMPLATES["qwen3"],
    "chatml": CHATML,
    "chatml_default_system": (
        "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful."
        "<|im_end|>\n{% endif %}" + CHATML
    ),
    "generation": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}<|eot_id|>{% endgeneration %}{% else %}{{ m['content'] }}"
        "<|eot_id|>{% endif %}{% endfor %}{% if add_generation_prompt %}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
}
CONVERSATIONS = {
    "one_turn": [
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "2 plus 2 is 4."},
    ],
    "system": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
    ],
    "multi_turn": [
        {"role": "system", "content": "You are a patient teacher."},
        {"role": "user", "content": "Spell cat backwards."},
        {"role": "assistant", "content": "tac"},
        {"role": "user", "content": "And dog?"},
        {"role": "assistant", "content": " god, with a space "},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome.\nBye."},
    ],
}


def _expected_turns(template: str, messages: list[dict]) -> list[str]:
    """The text each assistant turn trains on, written out by hand per template."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    out = []
    for i in turns:
        content = messages[i]["content"]
        if template == "llama3":
            out.append(content.strip() + "<|eot_id|>")
        elif template == "generation":
            out.append(content + "<|eot_id|>")
        elif template == "qwen3" and i == len(messages) - 1:  # its <think> block, trimmed
            out.append("<think>\n\n</think>\n\n" + content.strip() + "<|im_end|>")
        else:
            out.append(content + "<|im_end|>")
    if template in ("llama3", "generation"):  # the EOS after the last <|eot_id|> is trained
        out[-1] += "<|end_of_text|>"
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tokenizer folder per template: the shipped chat tokenizer with that template."""
    out = {}
    for name, template in TEMPLATES.items():
        folder = tmp_path_factory.mktemp(name)
        shutil.copy(chat_tokenizer_path() / "tokenizer.json", folder)
        config = json.loads((chat_tokenizer_path() / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        out[name] = folder
    return out


def _encoder(folder, train_on="assistant", **keys):
    tokenizer = load_tokenizer(folder)
    source = DataConfig(dataset="rows", dataset_format="chat", train_on=train_on, **keys)
    return build_chat_encoder(source, tokenizer), tokenizer


def _runs(ids: list[int], trained: list[bool]) -> list[list[int]]:
    """The maximal runs of consecutive trained tokens."""
    runs = itertools.groupby(zip(ids, trained, strict=True), key=lambda pair: pair[1])
    return [[i for i, _ in run] for keep, run in runs if keep]


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_ids_equal_transformers_and_trained_tokens_are_the_assistant_turns(
    folders, template, conversation
):
    messages = CONVERSATIONS[conversation]
    reference = transformers.AutoTokenizer.from_pretrained(folders[template])
    expected = reference.apply_chat_template(messages, tokenize=True)["input_ids"]
    encoder, tokenizer = _encoder(folders[template])
    ids, trained = encoder.encode({"messages": messages}, 0)
    eos = tokenizer.eos_id
    assert ids == (expected if expected[-1] == eos else [*expected, eos])
    assert len(trained) == len(ids)
    decoded = [tokenizer.decode(run) for run in _runs(ids, trained)]
    assert decoded == _expected_turns(template, messages)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_the_mask_equals_transformers_generation_mask(folders, conversation):
    """A template marking assistant text with ``{% generation %}``: transformers' own
    assistant mask is the trained tokens (the EOS titan appends aside)."""
    messages = CONVERSATIONS[conversation]
    reference = transformers.AutoTokenizer.from_pretrained(folders["generation"])
    out = reference.apply_chat_template(messages, return_assistant_tokens_mask=True)
    encoder, _ = _encoder(folders["generation"])
    ids, trained = encoder.encode({"messages": messages}, 0)
    assert ids[:-1] == out["input_ids"]
    assert trained[:-1] == [bool(m) for m in out["assistant_masks"]]
    assert sum(out["assistant_masks"]) > 0


def test_last_assistant_and_all(folders):
    messages = CONVERSATIONS["multi_turn"]
    encoder, tokenizer = _encoder(folders["llama3"], train_on="last_assistant")
    ids, trained = encoder.encode({"messages": messages}, 0)
    assert [tokenizer.decode(r) for r in _runs(ids, trained)] == [
        "You're welcome.\nBye.<|eot_id|><|end_of_text|>"
    ]
    encoder, _ = _encoder(folders["chatml"], train_on="all")
    ids, trained = encoder.encode({"messages": messages}, 0)
    assert all(trained)
    assert ids[-1] == tokenizer.eos_id


def test_offsets_of_the_tiktoken_and_the_hf_tokenizer_agree():
    """The shipped tiktoken file and the chat folder hold the same BPE: ordinary text gives
    the same ids and token starts through both ``encode_with_offsets``."""
    text = "Héllo, wörld! 12345 tokens\n\n  spaced  "
    assert load_tokenizer().encode_with_offsets(text) == load_tokenizer(
        "embedded_chat"
    ).encode_with_offsets(text)
    ids, starts = load_tokenizer("embedded_chat").encode_with_offsets(text)
    assert starts[0] == 0
    assert starts == sorted(starts)
    assert len(ids) == len(starts)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_packed_windows_keep_labels_shifted_with_ignore_index_across_cuts_and_resume(tmp_path):
    rows = [{"messages": CONVERSATIONS[name]} for name in sorted(CONVERSATIONS)] * 3
    dataset = _write_jsonl(tmp_path / "chat.jsonl", rows)
    config = DataConfig(
        dataset=dataset, dataset_format="chat", seq_len=16, local_batch_size=2, infinite=False
    )
    tokenizer = load_tokenizer("embedded_chat")
    encoder = build_chat_encoder(config, tokenizer)
    stream, marks = [], []
    for k, row in enumerate(rows):
        ids, trained = encoder.encode(row, k)
        stream += ids
        marks += trained
    batches = list(build_dataloader(config, tokenizer))
    assert len(batches) == len(stream) // 17 // 2
    for b, (inputs, labels) in enumerate(batches):
        for r in range(2):
            at = (2 * b + r) * 17
            window, mark = stream[at : at + 17], marks[at : at + 17]
            assert inputs[r].tolist() == window[:-1]
            expected = [t if m else IGNORE_INDEX for t, m in zip(window[1:], mark[1:], strict=True)]
            assert labels[r].tolist() == expected
    assert any((labels == IGNORE_INDEX).any() for _, labels in batches)
    # A resumed loader (mid-conversation) goes on with the same windows and marks.
    loader = build_dataloader(config, tokenizer)
    first = list(itertools.islice(loader, 3))
    resumed = build_dataloader(config, tokenizer)
    resumed.load_state_dict(loader.state_dict())
    rest = list(resumed)
    assert loader.state_dict()["token_offset"] > 0, "the cut is inside a conversation"
    for (a, b), (c, d) in zip(first + rest, batches, strict=True):
        assert torch.equal(a, c)
        assert torch.equal(b, d)


def test_prompt_and_response_columns_from_parquet(tmp_path):
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"question": ["Hi?", "Two?"], "answer": ["Hello.", "2"]}), path)
    config = DataConfig(
        dataset=str(path),
        dataset_format="chat",
        prompt_column="question",
        response_column="answer",
        seq_len=8,
        local_batch_size=1,
    )
    tokenizer = load_tokenizer("embedded_chat")
    encoder = build_chat_encoder(config, tokenizer)
    ids, trained = encoder.encode({"question": "Hi?", "answer": "Hello."}, 0)
    assert [tokenizer.decode(r) for r in _runs(ids, trained)] == ["Hello.<|eot_id|><|end_of_text|>"]
    assert tokenizer.decode(ids).startswith("<|begin_of_text|><|start_header_id|>user")
    inputs, _ = next(iter(build_dataloader(config, tokenizer)))
    assert inputs.tolist()[0] == ids[:8]


def test_a_row_without_the_column_is_refused_naming_the_row_and_its_columns(tmp_path):
    good = {"messages": CONVERSATIONS["one_turn"]}
    tokenizer = load_tokenizer("embedded_chat")
    first_bad = _write_jsonl(tmp_path / "a.jsonl", [{"text": "x", "id": 1}, good])
    config = DataConfig(dataset=first_bad, dataset_format="chat", seq_len=8, local_batch_size=1)
    message = (
        r"row 0 of '.*a\.jsonl' \(in .*\) has no column 'messages'; its columns are "
        r"\['id', 'text'\]\. Set training\.messages_column"
    )
    with pytest.raises(DataError, match=message) as error:
        build_dataloader(config, tokenizer)  # the first read, before any batch
    assert "\n" not in str(error.value)
    later_bad = _write_jsonl(tmp_path / "b.jsonl", [good] * 5 + [{"conversation": []}])
    config = DataConfig(
        dataset=later_bad, dataset_format="chat", seq_len=8, local_batch_size=1, infinite=False
    )
    with pytest.raises(DataError, match=r"row 5 of .* has no column 'messages'; .*'conversation'"):
        list(build_dataloader(config, tokenizer))
    with pytest.raises(DataError, match=r"message 0 is .* not a mapping with a 'role'"):
        build_chat_encoder(config, tokenizer).encode({"messages": ["hello"]}, 7)


def test_a_json_array_read_by_datasets(tmp_path):
    """A JSON array (not lines) goes through ``datasets``' reader: its rows hold every
    field of the messages' struct (``None`` where a message lacks one), dropped as
    transformers drops them; a row without the column is named by the encoder."""
    rows = [
        {"messages": [{"role": "system", "content": "Be brief.", "name": "x"},
                      *CONVERSATIONS["one_turn"]]},
        {"messages": CONVERSATIONS["system"]},
    ]  # fmt: skip
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(rows))
    tokenizer = load_tokenizer("embedded_chat")
    config = DataConfig(
        dataset=str(path), dataset_format="chat", seq_len=8, local_batch_size=1, infinite=False
    )
    loader = build_dataloader(config, tokenizer)
    encoder = build_chat_encoder(config, tokenizer)
    stream = [t for k, row in enumerate(rows) for t in encoder.encode(row, k)[0]]
    windows = [w for inputs, _ in loader for w in inputs.tolist()]
    assert windows == [stream[9 * k : 9 * k + 8] for k in range(len(stream) // 9)]
    path.write_text(json.dumps([{"chat": []}, *rows]))
    # datasets fills the column in (null): the message says so.
    with pytest.raises(DataError, match=r"row 0 of .* has a null 'messages'; .*\['chat', 'mes"):
        build_dataloader(config, tokenizer)


def test_a_template_that_does_not_mark_assistant_turns_is_refused(tmp_path):
    tokenizer = load_tokenizer("embedded_chat")
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    template = load_chat_template(str(plain), tokenizer, key="training.chat_template")
    with pytest.raises(DataError, match="does not mark assistant turns") as error:
        check_chat_template(template, "assistant", "training.chat_template")
    assert "\n" not in str(error.value)
    assert "train_on = 'all'" in str(error.value)
    check_chat_template(template, "all", "training.chat_template")  # every token: no turns needed


def test_template_sources_and_their_errors(tmp_path, folders):
    tokenizer = load_tokenizer(folders["qwen3"])
    assert load_chat_template(None, tokenizer, key="k").source == BUILTIN_TEMPLATES["qwen3"]
    (folders["qwen3"] / "chat_template.jinja").write_text(CHATML)  # transformers' precedence
    try:
        assert load_chat_template(None, tokenizer, key="k").source == CHATML
    finally:
        (folders["qwen3"] / "chat_template.jinja").unlink()
    assert load_chat_template("llama3", tokenizer, key="k").origin == "built-in llama3"
    with pytest.raises(DataError, match="has no chat template"):
        load_chat_template(None, load_tokenizer(), key="training.chat_template")
    with pytest.raises(DataError, match="'mistral' is neither a built-in template"):
        load_chat_template("mistral", tokenizer, key="training.chat_template")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(DataError, match="does not compile"):
        load_chat_template(str(bad), tokenizer, key="training.chat_template")


def test_chat_keys_are_checked():
    with pytest.raises(DataError, match=r"training\.train_on='assistants' is not allowed"):
        DataConfig(dataset_format="chat", train_on="assistants")
    with pytest.raises(DataError, match=r"training\.dataset_format='sft' is not allowed"):
        DataConfig(dataset_format="sft")
    with pytest.raises(DataError, match="set both"):
        DataConfig(dataset_format="chat", prompt_column="q")
    with pytest.raises(DataError, match="'embedded' is text"):
        build_dataloader(DataConfig(dataset_format="chat"), load_tokenizer("embedded_chat"))
