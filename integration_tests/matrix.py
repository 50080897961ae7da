"""The integration matrix: every parallelism and feature titan trains with, each a real
``titan-train`` run of a few steps on gloo (CPU), one line per row.

    hatch run integration                 # every row (about 20 minutes on 2 cores)
    hatch run integration fsdp pp_zbv     # the named rows (and the rows they need)
    hatch run integration --list          # the rows, what each runs, and exit

Every training row starts from its own initialization at the same ``training.seed`` (the
weights do not depend on the layout: no seed checkpoint), trains Llama 3 debugmodel (or the MoE
model the row names) for 4 steps of the same global batch (8 x 64 tokens) in fp32, and must
log the same losses as its reference row, one process, within the row's tolerance: a layout
that changes the math fails here. Rows that resume continue another row's folder from its
step 2 and must reproduce its steps 3 and 4. Others check what they leave on disk (an
export's dtype, a validation loss, generated text, an estimate's JSON). ``sft_chat_qwen3``
runs a user's fine-tuning story end to end: a tiny Qwen3 made by transformers, SFT with
document masking on the chat sample, ``titan-ckpt convert --to hf``, ``titan-train generate
--chat`` from the step and the export, and transformers greedy-decoding the export.

A row prints ``name ranks PASS|FAIL seconds detail``; the exit status is 1 if any failed.
CI runs a representative subset (``integration_tests/test_matrix.py``, rows with ``ci``).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

STEPS = 4
BATCH = 8  # sequences per step, over all data-parallel ranks
COMMON = (
    "--training.steps", str(STEPS),
    "--training.seq_len", "64",
    "--training.global_batch_size", str(BATCH),
    "--metrics.log_freq", "1",
    "--lr_scheduler.warmup_steps", "1",
    "--optimizer.lr", "0.003",
    "--parallelize.param_dtype", "float32",
    "--checkpoint.interval", "2",
)  # fmt: skip


def _degrees(**degrees: int) -> tuple[str, ...]:
    """Parallelism flags; ``dp_shard`` defaults to 1 so that a row says every degree."""
    names = {
        "dp_replicate": "data_parallel_replicate_degree",
        "dp_shard": "data_parallel_shard_degree",
        "cp": "context_parallel_degree",
        "tp": "tensor_parallel_degree",
        "pp": "pipeline_parallel_degree",
        "ep": "expert_parallel_degree",
    }
    degrees = {"dp_shard": 1, **degrees}
    return tuple(x for k, v in degrees.items() for x in (f"--parallelism.{names[k]}", str(v)))


@dataclass(frozen=True)
class Row:
    """One run of the matrix."""

    nproc: int
    args: tuple[str, ...] = ()
    local_batch: int | None = None
    """Sequences per rank per micro-batch; default: the global batch over the dp ranks."""
    reference: str | None = "single"
    """The row whose losses this one must log (None: no comparison)."""
    rtol: float = 2e-5
    resume_from: str | None = None
    """A row whose folder, without its last checkpoint, this one continues (from step 2)."""
    model: tuple[str, ...] = ()
    check: str | None = None
    """An extra check of what the run left on disk (a name in CHECKS)."""
    command: str = "train"
    ci: bool = False
    """Part of the CI subset (integration_tests/test_matrix.py)."""
    needs: tuple[str, ...] = field(default=())
    """Rows that must run first (a reference, a folder to resume or read)."""


MOE = ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel")
QWEN_MOE = ("--model.name", "qwen3", "--model.flavor", "debugmodel_moe")
MUON = ("--optimizer.name", "Muon")
ROWS: dict[str, Row] = {
    "single": Row(1, reference=None, ci=True),
    "fsdp": Row(2, _degrees(dp_shard=2)),
    "hsdp": Row(4, _degrees(dp_replicate=2, dp_shard=2), ci=True),
    "ddp": Row(2, _degrees(dp_replicate=2)),
    "tp": Row(2, _degrees(tp=2)),
    "fsdp_tp": Row(4, _degrees(dp_shard=2, tp=2)),
    "cp": Row(2, _degrees(cp=2)),
    "cp_ring": Row(2, (*_degrees(cp=2), "--parallelize.cp_attention", "titan_ring")),
    "fsdp_cp": Row(4, _degrees(dp_shard=2, cp=2)),
    "hsdp_cp": Row(8, _degrees(dp_replicate=2, dp_shard=2, cp=2)),
    "fsdp_tp_cp": Row(8, _degrees(dp_shard=2, tp=2, cp=2)),
    "pp_gpipe": Row(2, (*_degrees(pp=2), "--pipeline.schedule", "GPipe")),
    "pp_1f1b": Row(2, (*_degrees(pp=2), "--pipeline.schedule", "1F1B")),
    "pp_interleaved_1f1b": Row(
        2, (*_degrees(pp=2), "--pipeline.schedule", "Interleaved1F1B"), ci=True
    ),
    "pp_interleaved_zb": Row(2, (*_degrees(pp=2), "--pipeline.schedule", "InterleavedZeroBubble")),
    "pp_zbv": Row(2, (*_degrees(pp=2), "--pipeline.schedule", "ZBVZeroBubble")),
    "pp_fsdp": Row(4, (*_degrees(pp=2, dp_shard=2), "--pipeline.schedule", "1F1B")),
    "pp_tp": Row(4, (*_degrees(pp=2, tp=2), "--pipeline.schedule", "1F1B")),
    "pp_fsdp_tp": Row(8, (*_degrees(pp=2, dp_shard=2, tp=2), "--pipeline.schedule", "1F1B")),
    "pp_fsdp_tp_resume": Row(
        8,
        (*_degrees(pp=2, dp_shard=2, tp=2), "--pipeline.schedule", "1F1B"),
        resume_from="pp_fsdp_tp",
    ),
    "compile": Row(1, ("--parallelize.compile",), rtol=1e-4),
    "ac_selective_op": Row(
        1,
        (
            "--parallelize.activation_checkpoint.mode",
            "selective",
            "--parallelize.activation_checkpoint.selective_option",
            "op",
        ),
    ),
    "ac_full": Row(1, ("--parallelize.activation_checkpoint.mode", "full")),
    "grad_accumulation": Row(1, local_batch=2, ci=True),
    "optimizer_for_loop": Row(1, ("--optimizer.implementation", "for-loop")),
    "optimizer_foreach": Row(1, ("--optimizer.implementation", "foreach")),
    "resume_fsdp_on_one_rank": Row(1, resume_from="fsdp"),
    "export_bf16": Row(
        1,
        ("--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "bfloat16"),
        check="export_bf16",
    ),
    "validation": Row(
        2,
        (
            *_degrees(dp_shard=2),
            "--validation.enable",
            "--validation.freq",
            "2",
            "--validation.steps",
            "1",
            "--validation.seq_len",
            "64",
            "--validation.local_batch_size",
            "2",
        ),
        check="validation",
    ),
    "generate": Row(1, command="generate", needs=("single",), reference=None, check="generate"),
    "sft_chat_qwen3": Row(1, command="sft_chat", reference=None, ci=True),
    # One process plans rank 0 of FSDP 2 x TP 2 x PP 2 on a fake process group.
    "estimate": Row(
        1,
        _degrees(dp_shard=2, tp=2, pp=2),
        command="estimate",
        reference=None,
        check="estimate",
    ),
    "moe_single": Row(1, MOE, reference=None),
    "moe_ep": Row(2, (*MOE, *_degrees(dp_shard=2, ep=2)), reference="moe_single", rtol=1e-4),
    # Tensor parallel alone (no FSDP): every parameter a DTensor for the fused AdamW.
    "moe_tp": Row(2, (*MOE, *_degrees(tp=2)), reference="moe_single", rtol=1e-4),
    "moe_muon_single": Row(1, (*MOE, *MUON), reference=None),
    "moe_muon_ep": Row(
        2, (*MOE, *MUON, *_degrees(dp_shard=2, ep=2)), reference="moe_muon_single", rtol=1e-4
    ),
    "qwen3_moe_single": Row(1, QWEN_MOE, reference=None),
    # Tensor parallel without expert parallel: each tp rank holds 1/tp of every expert;
    # its checkpoint resumes in one process.
    "qwen3_moe_tp": Row(2, (*QWEN_MOE, *_degrees(tp=2)), reference="qwen3_moe_single", rtol=1e-4),
    "resume_qwen3_moe_tp_on_one_rank": Row(
        1, QWEN_MOE, resume_from="qwen3_moe_tp", reference="qwen3_moe_single", rtol=1e-4
    ),
    "qwen3_moe_ep_tp": Row(
        4, (*QWEN_MOE, *_degrees(dp_shard=2, ep=2, tp=2)), reference="qwen3_moe_single", rtol=1e-4
    ),
}


def _needs(row: Row) -> list[str]:
    return [n for n in (row.reference, row.resume_from, *row.needs) if n]


class Matrix:
    """Runs rows in a work folder, each after the rows it needs, each once."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.folders: dict[str, Path] = {}
        self.results: dict[str, tuple[bool, str]] = {}

    def run(self, name: str, *, echo: Callable[[str], None] = print) -> tuple[bool, str]:
        """Run ``name`` (and what it needs first); ``(passed, detail)``."""
        if name in self.results:
            return self.results[name]
        row = ROWS[name]
        for need in _needs(row):
            if not self.run(need, echo=echo)[0]:
                self.results[name] = (False, f"needs {need}, which failed")
                echo(_line(name, row, False, 0.0, self.results[name][1]))
                return self.results[name]
        started = time.perf_counter()
        try:
            passed, detail = self._run(name, row)
        except Exception as error:  # a row's failure is a result, not the end of the matrix
            passed, detail = False, f"{type(error).__name__}: {error}"
        self.results[name] = (passed, detail)
        echo(_line(name, row, passed, time.perf_counter() - started, detail))
        return passed, detail

    def _run(self, name: str, row: Row) -> tuple[bool, str]:
        folder = self.work / name
        if row.command == "generate":
            single = self.folders["single"]
            return CHECKS["generate"](single, _titan_generate(single))
        if row.command == "estimate":
            return CHECKS["estimate"](folder, _titan_estimate(row.args))
        if row.command == "sft_chat":
            return _sft_chat(folder)
        if row.resume_from:
            shutil.copytree(self.folders[row.resume_from], folder)
            shutil.rmtree(folder / "checkpoint" / f"step-{STEPS}")
            (folder / "metrics.jsonl").unlink()
        dp = _dp_degree(row.args)
        local = row.local_batch if row.local_batch is not None else BATCH // dp
        args = (
            "--job.dump_folder", str(folder),
            *COMMON,
            "--training.local_batch_size", str(local),
            *row.args,
        )  # fmt: skip
        output = _titan_train(row.nproc, args)
        self.folders[name] = folder
        ours = _losses(folder)
        detail = f"loss {ours[max(ours)]:.4f} at step {max(ours)}"
        reference = row.resume_from or row.reference
        if reference:
            theirs = _losses(self.folders[reference])
            steps = sorted(ours)
            if row.resume_from and steps != [3, 4]:
                return False, f"resumed at steps {steps}, expected [3, 4]"
            worst = max(abs(ours[s] - theirs[s]) / abs(theirs[s]) for s in steps)
            detail += f", max rel diff {worst:.1e} vs {reference}"
            if worst > row.rtol:
                return False, detail + f" > {row.rtol:g}"
        if row.check:
            return CHECKS[row.check](folder, output)
        return True, detail


def _dp_degree(args: tuple[str, ...]) -> int:
    degree = 1
    for key in ("data_parallel_replicate_degree", "data_parallel_shard_degree"):
        flag = f"--parallelism.{key}"
        if flag in args:
            degree *= int(args[args.index(flag) + 1])
    return degree


def _titan_train(nproc: int, args: tuple[str, ...]) -> str:
    command = [sys.executable, "-m", "titan_train.cli", "--nproc-per-node", str(nproc), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        start = done.stderr.find("Traceback")
        raise RuntimeError(f"exit {done.returncode}: {done.stderr[max(start, 0) :][-3000:]}")
    return done.stdout + done.stderr


def _titan_generate(folder: Path) -> str:
    command = [
        sys.executable, "-m", "titan_train.cli", "generate",
        "--checkpoint.path", str(folder / "checkpoint" / f"step-{STEPS}"),
        "--prompt", "The quick brown fox", "--max_new_tokens", "8", "--temperature", "0",
        "--no_stop_at_eos", "--json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"generate exit {done.returncode}: {done.stderr[-3000:]}")
    return done.stdout


def _titan_estimate(args: tuple[str, ...]) -> str:
    command = [
        sys.executable, "-m", "titan_train.cli", "estimate", *args,
        "--training.seq_len", "64", "--training.local_batch_size", "2", "--json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"estimate exit {done.returncode}: {done.stderr[-3000:]}")
    return done.stdout


# A tiny Qwen3, described once: titan's Qwen3Args field -> (transformers' Qwen3Config field,
# value). The flavor (debugmodel: tied embeddings) gives the rest.
QWEN3_TINY = {
    "dim": ("hidden_size", 64),
    "n_layers": ("num_hidden_layers", 2),
    "n_heads": ("num_attention_heads", 4),
    "n_kv_heads": ("num_key_value_heads", 2),
    "head_dim": ("head_dim", 16),
    "hidden_dim": ("intermediate_size", 128),
    "rope_theta": ("rope_theta", 10000.0),
}
CHAT_PROMPTS = ("What is the capital of Spain?", "How many letters are in 'garden'?")
CHAT_NEW = 8


def _tiny_qwen3(folder: Path) -> None:
    """A Qwen3 made by transformers (random weights, no download) with the shipped chat
    tokenizer's vocabulary, its tokenizer files (and chat template) copied beside it."""
    import torch
    import transformers

    from titan_train.tokenizer import chat_tokenizer_path, load_tokenizer

    hf = {name: value for name, value in QWEN3_TINY.values() if name != "rope_theta"}
    config = transformers.Qwen3Config(
        vocab_size=load_tokenizer("embedded_chat").vocab_size,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": QWEN3_TINY["rope_theta"][1]},
        **hf,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(chat_tokenizer_path() / name, folder)


def _cli(module: str, *args: str) -> str:
    """stdout of ``python -m module args`` (a RuntimeError with its stderr when it fails)."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"{module} {args[0]} exit {done.returncode}: {done.stderr[-3000:]}")
    return done.stdout


def _sft_chat(folder: Path) -> tuple[bool, str]:
    """HF Qwen3 -> SFT (chat sample, document masking) -> HF export -> ``generate --chat``
    from the step and the export -> transformers on the export: the same prompt ids (its
    ``apply_chat_template``) and the same greedy tokens."""
    import torch
    import transformers

    hf, export = folder / "hf", folder / "export"
    _tiny_qwen3(hf)
    _titan_train(1, (
        "--job.dump_folder", str(folder), *COMMON, "--training.local_batch_size", str(BATCH),
        "--model.name", "qwen3", "--model.flavor", "debugmodel",
        *(x for k, (_, v) in QWEN3_TINY.items() for x in (f"--model.args.{k}", str(v))),
        "--model.tokenizer_path", str(hf),
        "--training.dataset", "chat_sample", "--training.dataset_format", "chat",
        "--training.document_masking",
        "--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf",
    ))  # fmt: skip
    step = folder / "checkpoint" / f"step-{STEPS}"
    _cli("titan_ckpt.commands.cli", "convert", str(step), str(export), "--to", "hf")
    greedy = (
        "generate", "--chat", "--temperature", "0", "--max-new-tokens", str(CHAT_NEW),
        "--no-stop-at-eos", "--json", *(x for p in CHAT_PROMPTS for x in ("--prompt", p)),
    )  # fmt: skip
    # The step records its tokenizer (the HF folder); the export names none: the user does.
    runs = {
        "step": _cli("titan_train.cli", *greedy, "--checkpoint.path", str(step)),
        "export": _cli("titan_train.cli", *greedy, "--checkpoint.path", str(export),
                       "--model.tokenizer-path", str(hf)),
    }  # fmt: skip
    results = {k: json.loads(out[out.find("{") :])["results"] for k, out in runs.items()}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export)).eval()
    for prompt, ours, theirs in zip(CHAT_PROMPTS, results["step"], results["export"], strict=True):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=CHAT_NEW,
                                 min_new_tokens=CHAT_NEW, do_sample=False)  # fmt: skip
        tokens = {"step": ours["tokens"], "export": theirs["tokens"],
                  "transformers": out[0, len(ids) :].tolist()}  # fmt: skip
        if {ours["prompt_tokens"] == ids, theirs["prompt_tokens"] == ids} != {True}:
            return False, f"{prompt!r}: prompt ids {ours['prompt_tokens']} vs transformers' {ids}"
        if len({tuple(t) for t in tokens.values()}) != 1:
            return False, f"{prompt!r}: greedy tokens differ: {tokens}"
    losses = _losses(folder)
    return True, (
        f"loss {losses[1]:.3f} -> {losses[STEPS]:.3f}; {len(CHAT_PROMPTS)} chat prompts, "
        f"{CHAT_NEW} greedy tokens equal from the step, the export and transformers"
    )


def _losses(folder: Path, key: str = "loss") -> dict[int, float]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r[key] for r in map(json.loads, lines) if key in r}


def _check_export_bf16(folder: Path, _output: str) -> tuple[bool, str]:
    import torch
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(folder / "checkpoint" / f"step-{STEPS}")).read_metadata()
    dtypes = {
        getattr(m, "properties", None) and m.properties.dtype
        for m in meta.state_dict_metadata.values()
        if hasattr(m, "properties")
    }
    optimizer = [k for k in meta.state_dict_metadata if k.startswith("optimizer")]
    if dtypes != {torch.bfloat16} or optimizer:
        return False, f"last save holds {sorted(map(str, dtypes))}, optimizer keys {optimizer[:3]}"
    return True, "last save: model only, bfloat16"


def _check_validation(folder: Path, _output: str) -> tuple[bool, str]:
    losses = _losses(folder, "validation/loss")
    if sorted(losses) != [2, 4] or not all(math.isfinite(v) for v in losses.values()):
        return False, f"validation losses {losses}, expected finite ones at steps 2 and 4"
    return True, f"validation loss {losses[4]:.4f} at step 4"


def _check_generate(_folder: Path, output: str) -> tuple[bool, str]:
    start = output.find("{")
    record = json.loads(output[start : output.rfind("}") + 1])
    text = json.dumps(record)
    if '"text' not in text or ('"tokens' not in text and '"token_ids' not in text):
        return False, f"no generated tokens in {text[:300]}"
    return True, f"greedy sample of 8 tokens from step {STEPS}: {text[:80]}"


def _check_estimate(_folder: Path, output: str) -> tuple[bool, str]:
    report = json.loads(output)
    shards = report["layout"]["dp_shard"] * report["layout"]["tp"] * report["layout"]["pp"]
    resident = report["parameters"] + report["gradients"] + report["optimizer_state"]
    share = report["rank_params"] * shards / report["num_params"]
    if not report["step_simulated"] or report["peak"] < resident or not 0.95 < share < 1.05:
        return False, f"estimate {report}"
    return True, f"peak {report['peak'] / 2**20:.1f} MiB on rank 0 of {report['world_size']}"


CHECKS: dict[str, Callable[[Path, str], tuple[bool, str]]] = {
    "export_bf16": _check_export_bf16,
    "validation": _check_validation,
    "generate": _check_generate,
    "estimate": _check_estimate,
}


def _line(name: str, row: Row, passed: bool, seconds: float, detail: str) -> str:
    status = "PASS" if passed else "FAIL"
    return f"{name:<24} {row.nproc:>2} ranks  {status}  {seconds:6.1f} s  {detail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hatch run integration", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("rows", nargs="*", help="rows to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the rows and exit")
    parser.add_argument(
        "--keep", metavar="DIR", help="run in DIR and keep it (default: a temp dir)"
    )
    options = parser.parse_args(argv)
    unknown = [r for r in options.rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown row(s) {', '.join(unknown)}; known: {', '.join(ROWS)}")
    if options.list:
        for name, row in ROWS.items():
            print(f"{name:<24} {row.nproc:>2} ranks  {' '.join(row.args) or '(defaults)'}")
        return 0
    work = Path(options.keep or tempfile.mkdtemp(prefix="titan-matrix-"))
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        parser.error(f"{work} is not empty; name an empty or new folder (nothing is overwritten).")
    matrix = Matrix(work)
    names = options.rows or list(ROWS)
    for name in names:
        matrix.run(name)
    failed = [n for n, (ok, _) in matrix.results.items() if not ok]
    print(f"{len(matrix.results) - len(failed)} passed, {len(failed)} failed" + (
        f": {', '.join(failed)}" if failed else ""))  # fmt: skip
    if not options.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
