"""``titan-train generate --chat`` against transformers as the reference: each prompt, as a
user message rendered with the chat template and the generation prompt, has the ids of
``apply_chat_template(messages, add_generation_prompt=True)`` for the same tokenizer folder
(the shipped chat folder's Llama 3 template, a Qwen3 folder, ChatML with a default system
prompt, and ``--chat-template NAME|FILE`` over the folder's); a greedy run from such a
prompt is the naive argmax loop's; a folder without a template, a missing template file and
a template that fails are one message with exit status 2, before any model is built."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from titan_train.cli import main
from titan_train.data import BUILTIN_TEMPLATES
from titan_train.generate.cli import build_model, parse_generate_options, prepare
from titan_train.tokenizer import chat_tokenizer_path, load_tokenizer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PROMPTS = ["What is the capital of Spain?", "  spaces, <b>tags</b> & a newline\nhere  "]
CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def folder_with(path, template: str | None) -> str:
    """The shipped chat tokenizer folder with ``template`` (None: none at all)."""
    path.mkdir()
    shutil.copy(chat_tokenizer_path() / "tokenizer.json", path)
    config = json.loads((chat_tokenizer_path() / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def prompt_ids(*args: str) -> list[list[int]]:
    options = parse_generate_options(
        ["--chat", *(a for p in PROMPTS for a in ("--prompt", p)), *args]
    )
    return prepare(options, world_size=1).prompt_ids


def reference_ids(folder: str, chat_template: str | None = None) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}],
            chat_template=chat_template,
            add_generation_prompt=True,
            tokenize=True,
        )["input_ids"]
        for p in PROMPTS
    ]


@pytest.mark.parametrize("template", ["shipped", "qwen3", "chatml"])
def test_prompt_ids_equal_apply_chat_template(template, tmp_path):
    if template == "shipped":
        folder = str(chat_tokenizer_path())
    else:
        source = BUILTIN_TEMPLATES["qwen3"] if template == "qwen3" else CHATML
        folder = folder_with(tmp_path / template, source)
    ours = prompt_ids("--model.tokenizer-path", folder)
    assert ours == reference_ids(folder)
    if template == "shipped":  # the template writes the BOS; --bos adds none beside it
        bos = load_tokenizer(folder).bos_id
        assert ours[0][:2].count(bos) == 1
        assert prompt_ids("--model.tokenizer-path", folder, "--no-bos") == ours


def test_chat_template_by_name_or_file_over_the_folders(tmp_path):
    folder = str(chat_tokenizer_path())  # its own template is Llama 3's
    expected = reference_ids(folder, chat_template=BUILTIN_TEMPLATES["qwen3"])
    assert prompt_ids("--model.tokenizer-path", folder, "--chat-template", "qwen3") == expected
    jinja = tmp_path / "chatml.jinja"
    jinja.write_text(CHATML)
    ours = prompt_ids("--model.tokenizer-path", folder, "--chat-template", str(jinja))
    assert ours == reference_ids(folder, chat_template=CHATML)
    # Naming a template implies --chat.
    options = parse_generate_options(["--prompt", PROMPTS[0], "--chat-template", str(jinja)])
    options.model.tokenizer_path = folder
    assert prepare(options, world_size=1).prompt_ids == [ours[0]]


@torch.no_grad()
def test_greedy_from_a_chat_prompt_is_the_argmax_loop(capsys):
    args = ["--model.tokenizer-path", "embedded_chat", "--model.name", "llama3", "--chat"]
    args += ["--prompt", PROMPTS[0], "--temperature", "0", "--max-new-tokens", "4"]
    capsys.readouterr()
    assert main(["generate", *args, "--no-stop-at-eos", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["prompt_tokens"] == reference_ids(str(chat_tokenizer_path()))[0]
    assert result["prompt"].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    prepared = prepare(parse_generate_options(args), world_size=1)
    model = build_model(prepared, torch.device("cpu"))
    sequence = list(prepared.prompt_ids[0])
    for _ in range(4):
        sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
    assert result["tokens"] == sequence[len(prepared.prompt_ids[0]) :]


BAD = [
    (["--chat"], "--chat: --chat-template is not set and the tokenizer"),
    (["--chat", "--model.tokenizer-path", "{plain}"], "has no chat template"),
    (["--chat-template", "{tmp}/none.jinja"], "is neither a built-in template (llama3, qwen3)"),
    (["--chat-template", "{raises}"], "fails on a user message: TemplateError: no users"),
    (["--chat-template", "{broken}"], "does not compile"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=lambda v: str(v)[:40])
def test_bad_chat_input_exits_2_with_one_message(args, message, tmp_path, capsys):
    values = {"tmp": str(tmp_path), "plain": folder_with(tmp_path / "plain", None)}
    for name, text in {"raises": "{{ raise_exception('no users') }}", "broken": "{% if %}"}.items():
        (tmp_path / f"{name}.jinja").write_text(text)
        values[name] = str(tmp_path / f"{name}.jinja")
    capsys.readouterr()
    code = main(["generate", "--prompt", "hello", *(a.format(**values) for a in args)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
