"""``titan-train generate``: sample text from a titan checkpoint, a Hugging Face folder, or a
randomly initialized model.

    titan-train generate --checkpoint.path outputs/checkpoint/step-100 --prompt "Once upon"
    titan-train generate --checkpoint.path hf/llama --prompt-file prompts.txt --json
    titan-train generate --model.flavor debugmodel --prompt "smoke test" --max-new-tokens 8
    titan-train generate --nproc-per-node 2 --checkpoint.path ... --prompt ...   # tensor parallel
    titan-train generate --checkpoint.path hf/qwen3-chat --chat --prompt "What is RoPE?"

The source (``--checkpoint.path``):

- a titan DCP step folder (``step-<N>``), or a checkpoint folder (its newest committed
  step): the model record of its commit manifest names the model, flavor and real args; a
  step without one (torchtitan's) is described by ``--model.name`` / ``--model.flavor`` and
  the tokenizer's vocabulary. Its pickled metadata is read with titan-ckpt's restricted
  unpickler unless ``--checkpoint.trust-pickles``;
- a Hugging Face folder (``config.json`` + safetensors), read through the model family's
  state-dict adapter; the model family comes from ``--model.name`` or the config's
  ``model_type``;
- none: ``--model.name`` / ``--model.flavor`` with random weights (seeded by ``--seed``).

The tokenizer is ``--model.tokenizer-path``, else the one the checkpoint's record names
(titan-train records the run's), else the HF folder's own, else the shipped one.
With ``--chat`` each prompt is a user message rendered with the tokenizer folder's chat
template (or ``--chat-template``) and the assistant's generation prompt, tokenized as
transformers' ``apply_chat_template(..., add_generation_prompt=True)`` tokenizes it (the
template writes any BOS); the rendered text is the prompt printed and in ``--json``.
One prompt streams its continuation to stdout token by token; several print one block each
(``--json``: one JSON document). With ``--nproc-per-node N`` (or under torchrun) the model is
built on the meta device, tensor-parallelized over the N ranks with the family's plan,
materialized and loaded; rank 0 prints. Bad input (a sampling value, a path that is no
checkpoint, a tokenizer whose vocabulary the model lacks) is one message and exit status 2,
before the model is built.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import torch
from torch import nn
from tyro.conf import UseAppendAction

from titan_ckpt import CheckpointConfig, CheckpointManager
from titan_dims import ParallelDims
from titan_models import ModelSpec, ParallelizeConfig
from titan_train.errors import ConfigError, DataError
from titan_train.generate import SamplingConfig, generate
from titan_train.generate.source import GenerateCheckpoint, GenerateModel, Source, resolve_source
from titan_train.launch import destroy_group
from titan_train.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "GenerateOptions",
    "Prepared",
    "build_model",
    "parse_generate_options",
    "prepare",
    "run_generate",
]

logger = logging.getLogger("titan_train")


@dataclass(kw_only=True)
class GenerateParallelism:
    """Generation runs tensor parallel only, over every rank (--nproc-per-node N)."""

    tensor_parallel_degree: int = -1
    """Ranks the model is split over; -1: every rank."""
    data_parallel_replicate_degree: int = 1
    """Not used by generate: must be 1."""
    data_parallel_shard_degree: int = 1
    """Not used by generate: must be 1 (or -1)."""
    context_parallel_degree: int = 1
    """Not used by generate: must be 1."""
    pipeline_parallel_degree: int = 1
    """Not used by generate: must be 1."""
    expert_parallel_degree: int = 1
    """Not used by generate: must be 1."""


@dataclass(kw_only=True)
class GenerateOptions(SamplingConfig):
    """Sample text from a model. Every option is --key value (or --section.key value)."""

    prompt: UseAppendAction[list[str]] = field(default_factory=list)
    """A prompt; repeat the flag for a batch of prompts."""
    prompt_file: str | None = None
    """A text file of prompts, one per line (blank lines skipped), after any --prompt."""
    bos: bool = True
    """Begin each prompt with the tokenizer's beginning-of-text token, as training does
    (not with --chat: the chat template writes it)."""
    chat: bool = False
    """Render each prompt as a user message with the chat template and the assistant's
    generation prompt (transformers' apply_chat_template(..., add_generation_prompt=True)),
    as SFT on chat data renders conversations."""
    chat_template: str | None = None
    """The template --chat renders with (setting it implies --chat): a built-in (llama3,
    qwen3) or a .jinja file; empty: the tokenizer folder's (chat_template.jinja, else the
    chat_template of its tokenizer_config.json)."""
    json: bool = False
    """Print one JSON document (prompts, token ids, texts, why each stopped) instead of text."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The weights' dtype while generating (activations and the KV cache follow); loaded in
    float32 and cast. Keep float32 on CPU, where bfloat16 matmuls are slow."""
    checkpoint: GenerateCheckpoint = field(default_factory=GenerateCheckpoint)
    model: GenerateModel = field(default_factory=GenerateModel)
    parallelism: GenerateParallelism = field(default_factory=GenerateParallelism)

    def sampling(self) -> SamplingConfig:
        """The sampling settings alone."""
        return SamplingConfig(**{f.name: getattr(self, f.name) for f in fields(SamplingConfig)})


def parse_generate_options(argv: list[str]) -> GenerateOptions:
    """The options of a ``titan-train generate`` command line (``--help``: this module's
    docstring, then every option; tyro exits 2 on a malformed flag)."""
    import tyro

    from titan_train.config.loader import _plain_docstrings, check_int_ranges

    if {"-h", "--help"} & set(argv):
        # Printed as written: tyro would join the lines of each paragraph into one.
        print((__doc__ or "").replace("``", ""))
    with _plain_docstrings():
        options = tyro.cli(
            GenerateOptions,
            args=argv,
            prog="titan-train generate",
            use_underscores=False,
        )
    check_int_ranges(options, source="command line")  # e.g. a --seed torch cannot take
    return options


@dataclass(kw_only=True)
class Prepared:
    """Everything checked before any work: source, tokenizer, model args, prompts, layout."""

    options: GenerateOptions
    source: Source
    tokenizer: Tokenizer
    args: Any
    prompts: list[str]
    prompt_ids: list[list[int]]
    tp: int


def prepare(options: GenerateOptions, world_size: int) -> Prepared:
    """Check every input and describe the model (``ConfigError`` / ``ModelConfigError``,
    exit 2, before any model is built)."""
    tp = _tensor_parallel_degree(options.parallelism, world_size)
    prompts = _prompts(options)
    source = resolve_source(options.checkpoint, options.model)
    tokenizer_path = options.model.tokenizer_path or source.tokenizer_path
    tokenizer = load_tokenizer(tokenizer_path)
    if options.chat or options.chat_template is not None:
        prompts, prompt_ids = _chat_prompts(options.chat_template, tokenizer, prompts)
    else:
        prompt_ids = [tokenizer.encode(p, bos=options.bos) for p in prompts]
    empty = [i + 1 for i, ids in enumerate(prompt_ids) if not ids]
    if empty:
        raise ConfigError(f"Prompt(s) {empty} encode to no tokens; give text or keep --bos.")
    dims = ParallelDims(world_size=tp, tp=tp, dp_shard=1)
    longest = max(map(len, prompt_ids)) + options.max_new_tokens
    # The plan's check wants a length its sequence parallel splits evenly (the RoPE table's
    # size only; the lengths generation feeds are any).
    longest = -(-longest // dims.seq_len_divisor) * dims.seq_len_divisor
    args = _model_args(source, tokenizer.vocab_size, longest)
    model_vocab = int(args.vocab_size)
    if tokenizer.vocab_size > model_vocab:
        raise ConfigError(
            f"The tokenizer ({tokenizer_path or 'shipped'}) has {tokenizer.vocab_size} ids, "
            f"the model's vocabulary {model_vocab}: ids it would give have no embedding. Give "
            "the tokenizer the model was trained with (--model.tokenizer-path)."
        )
    if tp > 1 and not (options.kv_cache and _has_cache(source.spec)):
        raise ConfigError(
            f"Tensor parallel generation (tp={tp}) needs the KV cache: "
            + (
                "leave --kv-cache on."
                if options.kv_cache is False
                else f"{source.spec.name} has none; generate in one process."
            )
        )
    if tp > 1 and source.spec.check_fn is not None:
        source.spec.check_fn(args, dims, ParallelizeConfig(loss_parallel=False), seq_len=longest)
    return Prepared(
        options=options,
        source=source,
        tokenizer=tokenizer,
        args=args,
        prompts=prompts,
        prompt_ids=prompt_ids,
        tp=tp,
    )


def _has_cache(spec: ModelSpec) -> bool:
    """Whether the family's model takes a KV cache (``forward(tokens, cache=...)``)."""
    forward = getattr(spec.model_cls, "forward", None)
    return forward is not None and "cache" in inspect.signature(forward).parameters


def _tensor_parallel_degree(parallelism: GenerateParallelism, world_size: int) -> int:
    for f in fields(GenerateParallelism):
        value = getattr(parallelism, f.name)
        allowed = (1, -1) if f.name == "data_parallel_shard_degree" else (1,)
        if f.name != "tensor_parallel_degree" and value not in allowed:
            raise ConfigError(
                f"--parallelism.{f.name} {value}: generate runs tensor parallel only (the "
                "model split over every rank, --nproc-per-node N); leave it at 1."
            )
    tp = parallelism.tensor_parallel_degree
    tp = world_size if tp == -1 else tp
    if tp != world_size:
        raise ConfigError(
            f"--parallelism.tensor_parallel_degree {tp} must equal the number of ranks "
            f"({world_size}): generate splits the model over every rank. Leave it at -1."
        )
    return tp


def _prompts(options: GenerateOptions) -> list[str]:
    prompts = list(options.prompt)
    if options.prompt_file:
        try:
            with open(options.prompt_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as error:
            raise ConfigError(f"--prompt-file {options.prompt_file}: {error}") from error
    if not prompts:
        raise ConfigError(
            "Nothing to generate from: give --prompt TEXT (repeatable) or --prompt-file."
        )
    return prompts


def _chat_prompts(
    name: str | None, tokenizer: Tokenizer, prompts: list[str]
) -> tuple[list[str], list[list[int]]]:
    """Each prompt as a user message rendered with the chat template ``name`` and the
    generation prompt: the texts and their ids (those ``apply_chat_template`` gives)."""
    from titan_train.data.chat_template import load_chat_template  # jinja2: only for --chat

    try:
        template = load_chat_template(name, tokenizer, key="--chat-template")
    except DataError as error:
        raise ConfigError(f"--chat: {error}") from None
    if not callable(getattr(tokenizer, "encode_with_offsets", None)):
        raise ConfigError(
            f"--chat needs a tokenizer that reads special-token names in text; "
            f"{type(tokenizer).__name__} cannot. Give a tokenizer.json folder or a tiktoken "
            "file (--model.tokenizer-path)."
        )
    texts = []
    for prompt in prompts:
        try:
            texts.append(
                template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
            )
        except Exception as error:  # the template's own (raise_exception, a bad key)
            raise ConfigError(
                f"--chat: the chat template ({template.origin}) fails on a user message: "
                f"{type(error).__name__}: {error}"
            ) from None
    return texts, [tokenizer.encode_with_offsets(text)[0] for text in texts]


def _model_args(source: Source, vocab_size: int, max_seq_len: int) -> Any:
    """The model's args, long enough for the prompts and the new tokens (``max_seq_len``
    only sizes the RoPE table: it does not change what the model computes)."""
    if source.args is None:
        return source.spec.args_fn(source.flavor, vocab_size=vocab_size, max_seq_len=max_seq_len)
    values = dict(source.args)
    values["max_seq_len"] = max(int(values.get("max_seq_len") or 0), max_seq_len)
    return source.spec.args_fn(source.flavor, **values)


def build_model(prepared: Prepared, device: torch.device) -> nn.Module:
    """The model on ``device``: meta, tensor-parallelized over the ranks, materialized, then
    loaded from the source (or initialized from ``--seed``)."""
    spec, tp = prepared.source.spec, prepared.tp
    with torch.device("meta"):
        model = spec.model_cls(prepared.args)
    if tp > 1:
        dims = ParallelDims(world_size=tp, tp=tp, dp_shard=1, device_type=device.type)
        # Replicated logits (no loss parallel): every rank samples from the whole vocabulary.
        model = spec.parallelize_fn(model, dims, ParallelizeConfig(loss_parallel=False))
    model.to_empty(device=device)
    torch.manual_seed(prepared.options.seed)
    model.init_weights(buffer_device=device)
    _load_weights(model, prepared)
    _cast_parameters(model, DTYPES[prepared.options.dtype])
    return model.eval()


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the parameters alone: buffers such as a RoPE table keep their float32 precision."""
    if dtype == torch.float32:
        return
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(
                name, nn.Parameter(param.detach().to(dtype), requires_grad=False)
            )


def _load_weights(model: nn.Module, prepared: Prepared) -> None:
    """Load the source's weights through titan-ckpt (its restricted unpickler for DCP, the
    family's adapter for HF), resharded onto this model's layout."""
    source = prepared.source
    if source.kind == "random":
        return
    with tempfile.TemporaryDirectory(prefix="titan-generate-") as folder:
        config = CheckpointConfig(
            enable=True,
            load_only=True,
            folder=folder,
            initial_load_path=source.path,
            initial_load_model_only=True,
            initial_load_in_hf=source.kind == "hf",
            trust_pickles=prepared.options.checkpoint.trust_pickles,
        )
        adapter = source.adapter
        manager = CheckpointManager(config, model_parts=[model], state_dict_adapter=adapter)
        try:
            manager.load()
        finally:
            manager.close()


def run_generate(options: GenerateOptions) -> int:
    """Generate as ``options`` say, in this process (one rank of a tensor-parallel job under
    torchrun); returns the exit status."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    prepared = prepare(options, world_size)
    if world_size > 1:
        from titan_dims import init_distributed

        device = init_distributed()
    else:
        from titan_dims import detect_device_type

        device = torch.device(detect_device_type())
    try:
        return _generate_and_print(prepared, device)
    finally:
        if world_size > 1:
            destroy_group()


def _generate_and_print(prepared: Prepared, device: torch.device) -> int:
    import torch.distributed as dist

    options, tokenizer = prepared.options, prepared.tokenizer
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = build_model(prepared, device)
    if tokenizer.vocab_size < int(prepared.args.vocab_size):
        logger.info(
            "The model's vocabulary (%d) is larger than the tokenizer's (%d): sampling only "
            "the tokenizer's ids.",
            prepared.args.vocab_size,
            tokenizer.vocab_size,
        )
    stream = (
        _Streamer(tokenizer, tokenizer.eos_id if options.stop_at_eos else None)
        if rank == 0 and len(prepared.prompts) == 1 and not options.json
        else None
    )
    if stream is not None:
        print(prepared.prompts[0], end="", flush=True)
    begin = time.perf_counter()
    outputs = generate(
        model,
        prepared.prompt_ids,
        options.sampling(),
        eos_id=tokenizer.eos_id,
        vocab_size=tokenizer.vocab_size,
        device=device,
        on_token=stream,
        multiple=prepared.tp,
    )
    seconds = time.perf_counter() - begin
    if rank != 0:
        return 0
    new_tokens = sum(map(len, outputs))
    logger.info(
        "%d new tokens in %.2f s (%.1f tokens/s)", new_tokens, seconds, new_tokens / seconds
    )
    results = _results(prepared, outputs)
    if options.json:
        print(json.dumps(_document(prepared, results, seconds), ensure_ascii=False))
    elif stream is not None:
        stream.finish()
    else:
        for i, result in enumerate(results, 1):
            print(f"### prompt {i} of {len(results)} ({result['finish_reason']})")
            print(result["prompt"] + result["text"])
            print()
    sys.stdout.flush()
    return 0


def _results(prepared: Prepared, outputs: list[list[int]]) -> list[dict[str, Any]]:
    """Each prompt's outcome: its ids, the new ids, their text (without the end-of-text token
    that ended it) and why it stopped (``eos`` or ``length``)."""
    tokenizer, stop = prepared.tokenizer, prepared.options.stop_at_eos
    results = []
    for prompt, ids, out in zip(prepared.prompts, prepared.prompt_ids, outputs, strict=True):
        ended = stop and bool(out) and out[-1] == tokenizer.eos_id
        results.append(
            {
                "prompt": prompt,
                "prompt_tokens": ids,
                "tokens": out,
                "text": tokenizer.decode(out[:-1] if ended else out),
                "finish_reason": "eos" if ended else "length",
            }
        )
    return results


def _document(prepared: Prepared, results: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    source = prepared.source
    return {
        "source": {"kind": source.kind, "path": source.path},
        "model": {"name": source.spec.name, "flavor": source.flavor},
        "sampling": asdict(prepared.options.sampling()),
        "tensor_parallel_degree": prepared.tp,
        "dtype": prepared.options.dtype,
        "seconds": round(seconds, 3),
        "results": results,
    }


class _Streamer:
    """Prints one prompt's continuation as its tokens come: each time, the text decoded so
    far minus what is already printed, held back while it ends in a partial character."""

    def __init__(self, tokenizer: Tokenizer, eos_id: int | None) -> None:
        self.tokenizer, self.eos_id = tokenizer, eos_id
        self.tokens: list[int] = []
        self.printed = ""

    def __call__(self, row: int, token: int) -> None:
        if token == self.eos_id:  # the end, not text
            return
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd") or not text.startswith(self.printed):
            return
        print(text[len(self.printed) :], end="", flush=True)
        self.printed = text

    def finish(self) -> None:
        text = self.tokenizer.decode(self.tokens)
        rest = text[len(self.printed) :] if text.startswith(self.printed) else ""
        print(rest, flush=True)
