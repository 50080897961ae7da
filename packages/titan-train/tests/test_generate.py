"""``titan-train generate`` as a user runs it (the real CLI, a checkpoint trained by
titan-train in this module, a Hugging Face folder written by transformers), checked against:
a naive loop that re-runs the whole sequence and takes the argmax (greedy, with and without
the KV cache, one prompt and a batch); transformers' own greedy ``generate`` on the same
weights; itself (a seed repeats, top-k 1 and a tiny top-p are greedy); one process (tensor
parallel on 2 gloo ranks); and one clear message with exit status 2 for bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist

from titan_models.llama3 import LLAMA3, llama3_args
from titan_train.cli import main
from titan_train.config.model_args import model_metadata
from titan_train.generate import SamplingConfig, generate, sample_next
from titan_train.generate.cli import build_model, parse_generate_options, prepare

TINY = [
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--training.steps", "4",
    "--optimizer.lr", "3e-3",
    "--metrics.no_enable_tensorboard",
    "--checkpoint.enable",
    "--checkpoint.interval", "4",
    "--lr_scheduler.warmup_steps", "1",
]  # fmt: skip
PROMPTS = ["Once upon a time", "The", "A model of the world is"]
NEW = 10


@pytest.fixture(scope="module")
def step(tmp_path_factory) -> str:
    """A titan DCP step of the Llama 3 debug model, trained for a few steps."""
    dump = tmp_path_factory.mktemp("run")
    assert main(["train", *TINY, "--job.dump_folder", str(dump)]) == 0
    return str(dump / "checkpoint" / "step-4")


def generate_json(args: list[str], capsys) -> list[list[int]]:
    """The token ids ``titan-train generate ... --json`` prints, one list per prompt."""
    capsys.readouterr()
    assert main(["generate", *args, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    return [result["tokens"] for result in document["results"]]


def prompt_args(prompts: list[str]) -> list[str]:
    return [arg for p in prompts for arg in ("--prompt", p)]


GREEDY = ["--temperature", "0", "--max_new_tokens", str(NEW), "--no-stop_at_eos"]


@pytest.fixture(scope="module")
@torch.no_grad()
def naive_greedy(step: str) -> list[list[int]]:
    """For each of PROMPTS: re-run the whole sequence for every new token and take the
    highest logit."""
    options = parse_generate_options(["--checkpoint.path", step, *prompt_args(PROMPTS)])
    prepared = prepare(options, world_size=1)
    model = build_model(prepared, torch.device("cpu"))
    outputs = []
    for ids in prepared.prompt_ids:
        sequence = list(ids)
        for _ in range(NEW):
            sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
        outputs.append(sequence[len(ids) :])
    return outputs


@pytest.mark.parametrize("cache", ["--kv_cache", "--no-kv_cache"])
def test_greedy_equals_a_naive_reforward_loop(step, cache, naive_greedy, capsys):
    expected = naive_greedy
    batch = generate_json(
        ["--checkpoint.path", step, *prompt_args(PROMPTS), *GREEDY, cache], capsys
    )
    assert batch == expected
    single = generate_json(
        ["--checkpoint.path", step, "--prompt", PROMPTS[2], *GREEDY, cache], capsys
    )
    assert single == [expected[2]]


def test_one_prompt_streams_prompt_and_continuation_as_text(step, capsys):
    capsys.readouterr()
    assert main(["generate", "--checkpoint.path", step, "--prompt", PROMPTS[0], *GREEDY]) == 0
    out = capsys.readouterr().out
    [tokens] = generate_json(["--checkpoint.path", step, "--prompt", PROMPTS[0], *GREEDY], capsys)
    prepared = prepare(parse_generate_options(["--prompt", "x"]), world_size=1)
    assert out == PROMPTS[0] + prepared.tokenizer.decode(tokens) + "\n"


def test_a_batch_prints_one_block_per_prompt(step, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS[:2]) + "\n\n")
    capsys.readouterr()
    assert main(["generate", "--checkpoint.path", step, "--prompt_file", str(path), *GREEDY]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"### prompt 1 of 2 (length)\n{PROMPTS[0]}")
    assert f"\n### prompt 2 of 2 (length)\n{PROMPTS[1]}" in out


def test_a_seed_repeats_and_top_k_1_or_a_tiny_top_p_is_greedy(step, capsys):
    base = ["--checkpoint.path", step, *prompt_args(PROMPTS[:2]), "--max_new_tokens", "16"]
    sampled = generate_json([*base, "--temperature", "1.0", "--seed", "3"], capsys)
    assert generate_json([*base, "--temperature", "1.0", "--seed", "3"], capsys) == sampled
    assert generate_json([*base, "--temperature", "1.0", "--seed", "4"], capsys) != sampled
    greedy = generate_json([*base, "--temperature", "0"], capsys)
    assert sampled != greedy
    assert generate_json([*base, "--seed", "5", "--top_k", "1"], capsys) == greedy
    assert generate_json([*base, "--seed", "5", "--top_p", "1e-6"], capsys) == greedy


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]])).repeat(400, 1)
    generator = torch.Generator().manual_seed(0)

    def support(**settings) -> set[int]:
        sampling = SamplingConfig(temperature=1.0, **settings)
        return set(sample_next(logits, sampling, generator).tolist())

    assert support() == {0, 1, 2, 3}
    assert support(top_k=2) == {1, 3}
    assert support(top_p=0.5) == {1, 3}  # 0.4 < 0.5: the next most likely joins
    assert support(top_p=0.4) == {1}
    assert support(top_k=3, top_p=0.65) == {1, 3}


def test_a_hugging_face_folder_gives_transformers_greedy_tokens(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.2, bos_token_id=2040, eos_token_id=2041, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    args = ["--checkpoint.path", str(tmp_path / "hf"), *prompt_args(PROMPTS), *GREEDY]
    ours = generate_json(args, capsys)
    prepared = prepare(parse_generate_options(args), world_size=1)
    for ids, tokens in zip(prepared.prompt_ids, ours, strict=True):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
            )
        assert tokens == out[0, len(ids) :].tolist()


def test_tensor_parallel_on_two_ranks_gives_the_single_process_tokens(step, capfd):
    args = ["--checkpoint.path", step, *prompt_args(PROMPTS), *GREEDY, "--json"]
    assert main(["generate", *args]) == 0
    single = json.loads(capfd.readouterr().out)["results"]
    assert main(["generate", "--nproc-per-node", "2", *args]) == 0
    out = capfd.readouterr().out
    document = json.loads(out)  # rank 0 alone prints: one document
    assert document["tensor_parallel_degree"] == 2
    assert [r["tokens"] for r in document["results"]] == [r["tokens"] for r in single]


def hf_folder_of_vocab(path, vocab: int) -> str:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


BAD = [
    (["--checkpoint.path", "{tmp}/missing"], "--checkpoint.path {tmp}/missing does not exist"),
    (["--checkpoint.path", "{tmp}"], "is neither a DCP checkpoint step"),
    (["--checkpoint.path", "{step}", "--model.name", "deepseek_v3"], "holds a llama3 model"),
    (["--checkpoint.path", "{step}", "--model.flavor", "8B"], "not --model.flavor 8B"),
    (["--checkpoint.path", "{hf}"], "has 2048 ids, the model's vocabulary 1000"),
    (["--temperature", "-1"], "temperature=-1.0 is not allowed"),
    (["--top_k", "-1"], "top_k=-1 is not allowed"),
    (["--top_p", "0"], "top_p=0.0 is not allowed"),
    (["--top_p", "1.5"], "top_p=1.5 is not allowed"),
    (["--max_new_tokens", "0"], "max_new_tokens=0 is not allowed"),
    (["--seed", str(10**30)], f"seed={10**30} is not allowed; a whole number here must be in"),
    (["--dtype", "int8"], "--dtype"),
    (["--parallelism.context_parallel_degree", "2"], "generate runs tensor parallel only"),
    (["--parallelism.tensor_parallel_degree", "2"], "must equal the number of ranks (1)"),
    (["--checkpoint.path", "{interrupted}"], "never committed it (an interrupted save)"),
    (["--nproc-per-node", "2", "--no-kv_cache"], "needs the KV cache: leave --kv-cache on"),
    (["--prompt_file", "{tmp}/none.txt"], "--prompt-file {tmp}/none.txt"),
    (["--model.name", "gpt7"], "model.name='gpt7' is not a registered model"),
    (["--model.flavor", "13B"], "Unknown Llama 3 flavor '13B'"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=lambda v: str(v)[:40])
def test_bad_input_exits_2_with_one_message(args, message, step, tmp_path, capsys):
    values = {"tmp": str(tmp_path), "step": step}
    if any("{hf}" in a for a in args):
        values["hf"] = hf_folder_of_vocab(tmp_path / "hf", 1000)
    if any("{interrupted}" in a for a in args):  # a step whose commit marker never came
        values["interrupted"] = str(tmp_path / "step-4")
        shutil.copytree(step, values["interrupted"])
        (tmp_path / "step-4" / "titan-commit.json").unlink()
    args = [a.format(**values) for a in args]
    capsys.readouterr()
    try:
        code = main(["generate", "--prompt", "hello", *args])
    except SystemExit as exit_info:  # tyro's own parse errors
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert message.format(**values) in err
    assert "Traceback" not in err
    assert not dist.is_initialized()


def test_no_prompt_exits_2(capsys):
    assert main(["generate"]) == 2
    assert "give --prompt TEXT (repeatable) or --prompt-file" in capsys.readouterr().err


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as done:
        main(["generate", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--prompt", "--prompt-file", "--max-new-tokens", "--temperature", "--top-k", "--top-p",
        "--seed", "--kv-cache", "--stop-at-eos", "--bos", "--json", "--checkpoint.path",
        "--checkpoint.trust-pickles", "--model.name", "--model.flavor", "--model.tokenizer-path",
        "--parallelism.tensor-parallel-degree", "--dtype", "--chat", "--chat-template",
    ):  # fmt: skip
        assert flag in out, flag  # kebab-case, as the other commands spell theirs
    assert "\n- titan-train" not in out  # the examples as written, no markdown list


def test_the_recorded_tokenizer_is_the_default(step, tmp_path, capsys):
    """titan-train records the run's tokenizer with each step; generate loads it unless
    --model.tokenizer_path says otherwise."""
    copy = tmp_path / "step-4"
    shutil.copytree(step, copy)
    commit = json.loads((copy / "titan-commit.json").read_text())
    assert "tokenizer_path" not in commit["metadata"]["model"]  # the shipped one: no record
    commit["metadata"]["model"]["tokenizer_path"] = str(tmp_path / "gone.json")
    (copy / "titan-commit.json").write_text(json.dumps(commit))
    assert main(["generate", "--checkpoint.path", str(copy), "--prompt", "x"]) == 2
    assert str(tmp_path / "gone.json") in capsys.readouterr().err
    args = ["--checkpoint.path", str(copy), "--prompt", "x", *GREEDY, "--max_new_tokens", "2"]
    assert len(generate_json([*args, "--model.tokenizer_path", "embedded"], capsys)[0]) == 2


def test_model_metadata_records_the_tokenizer_as_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = llama3_args("debugmodel")
    record = model_metadata(LLAMA3, "debugmodel", args, tokenizer_path="tok/tokenizer.json")
    assert record["model"]["tokenizer_path"] == str(tmp_path / "tok" / "tokenizer.json")
    assert "tokenizer_path" not in model_metadata(LLAMA3, "debugmodel", args)["model"]


class Uncached(torch.nn.Module):
    """A model family without a KV cache: ``forward(tokens)`` only."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)


def test_a_model_without_a_cache_re_runs_the_sequence_and_says_so_once(step, caplog):
    options = parse_generate_options(["--checkpoint.path", step, *prompt_args(PROMPTS)])
    prepared = prepare(options, world_size=1)
    model = build_model(prepared, torch.device("cpu"))
    sampling = SamplingConfig(temperature=0, max_new_tokens=4, stop_at_eos=False)
    cached = generate(model, prepared.prompt_ids, sampling)
    caplog.clear()
    assert generate(Uncached(model), prepared.prompt_ids, sampling) == cached
    notes = [r for r in caplog.records if "has no KV cache: every new token re-runs" in r.message]
    assert len(notes) == 1


def test_deepseek_v3_generates_with_its_cache(capsys):
    """The other family with a cache: random weights, one prompt cached and re-run agree."""
    args = ["--model.name", "deepseek_v3", *prompt_args(PROMPTS[:2]), "--temperature", "0",
            "--max_new_tokens", "4", "--no-stop_at_eos"]  # fmt: skip
    assert generate_json(args, capsys) == generate_json([*args, "--no-kv_cache"], capsys)


def test_qwen3_generates_with_its_cache(capsys):
    """Qwen3 (QK-norm, half-split RoPE) has the cache too: cached and re-run tokens agree."""
    args = ["--model.name", "qwen3", *prompt_args(PROMPTS[:2]), "--temperature", "0",
            "--max_new_tokens", "4", "--no-stop_at_eos"]  # fmt: skip
    assert generate_json(args, capsys) == generate_json([*args, "--no-kv_cache"], capsys)


def test_bfloat16_weights_generate(step, capsys):
    args = ["--checkpoint.path", step, "--prompt", PROMPTS[0], *GREEDY, "--dtype", "bfloat16"]
    capsys.readouterr()
    assert main(["generate", *args, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["dtype"] == "bfloat16"
    assert len(document["results"][0]["tokens"]) == NEW
