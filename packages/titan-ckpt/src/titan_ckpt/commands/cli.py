"""The ``titan-ckpt`` command: inspect, verify, diff and convert checkpoints.

    titan-ckpt inspect outputs/checkpoint              # every step: committed?, size, age
    titan-ckpt verify outputs/checkpoint/step-1000     # exit 0 clean, 1 damaged/uncommitted
    titan-ckpt diff step-1000 converted.safetensors    # exit 0 equal, 1 different
    titan-ckpt convert step-1000 hf-out --to hf        # a titan-train step records its model

Bad usage prints one ``titan-ckpt: error: ...`` line and exits 2; a pickle asking for a
global outside the allowlist is refused with exit 1 unless ``--trust-pickles``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
import textwrap
import time
from collections.abc import Sequence

import torch

from titan_ckpt.__about__ import __version__
from titan_ckpt.commands.convert import ROPE_SCALINGS, TARGETS, ConvertOptions, convert
from titan_ckpt.commands.diff import diff_paths, render_diff
from titan_ckpt.commands.inspect import inspect_path, render
from titan_ckpt.commands.verify import verify_path
from titan_ckpt.errors import (
    CheckpointConfigError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointReadError,
    UnsafeCheckpointError,
)

__all__ = ["flag_text", "main", "parse_size"]

_DTYPES = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16", "float64")}
_DTYPES |= {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


_EXAMPLES = [
    line.strip() for line in (__doc__ or "").splitlines() if line.startswith("    titan-ckpt ")
]
"""The example lines of this module's docstring, each with its comment."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"titan-ckpt: error: {message}\n")


def _add_command(
    commands: argparse._SubParsersAction, name: str, *, help: str, description: str
) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` shows its description (wrapped) and then its examples,
    one a line: the lines of ``_EXAMPLES`` that start with ``titan-ckpt NAME``. Every
    subcommand reads checkpoints, so each takes ``--trust-pickles``."""
    examples = [line for line in _EXAMPLES if line.startswith(f"titan-ckpt {name} ")]
    parser = commands.add_parser(
        name,
        help=help,
        description=textwrap.fill(description, width=88),
        epilog="examples:\n" + "\n".join(f"  {line}" for line in examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--trust-pickles",
        action="store_true",
        help="unpickle DCP metadata and records without the allowlist (DCP types, torch "
        "sizes/dtypes/tensors, plain containers): only for checkpoints you made yourself with "
        "custom objects; a stranger's pickle can run code",
    )
    return parser


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="titan-ckpt",
        description="Inspect, verify, diff and convert checkpoints (DCP, safetensors, HF, "
        "torch.save).",
        epilog="examples:\n" + "\n".join(f"  {line}" for line in _EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"titan-ckpt {__version__}")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    _add_inspect(commands)
    _add_verify(commands)
    _add_diff(commands)
    _add_convert(commands)
    return parser


def _add_inspect(commands: argparse._SubParsersAction) -> None:
    inspect = _add_command(
        commands,
        "inspect",
        help="list steps, or every key's shape, dtype, bytes and sharding",
        description="For a checkpoint folder: its steps, committed or not, size and age. For "
        "a DCP step, safetensors file or folder, or torch.save file: every key's shape, dtype "
        "and bytes (DCP: shards and ranks), grouped by top-level state with totals, reading "
        "metadata only unless --stats.",
    )
    inspect.add_argument("path", help="checkpoint folder, step directory or file")
    inspect.add_argument("--json", action="store_true", help="print JSON for scripts")
    inspect.add_argument(
        "--stats", action="store_true", help="load tensors: min, max, mean, std, NaN/Inf counts"
    )


def _add_verify(commands: argparse._SubParsersAction) -> None:
    verify = _add_command(
        commands,
        "verify",
        help="check the commit marker, manifest, shard coverage and readability",
        description="Exit 0 if intact, 1 if damaged (naming files and keys) or a step whose "
        "save never committed (a run will not load it), 2 on bad usage "
        "or a manifest whose checksums cannot be computed here (xxh3_128 without the xxhash "
        "package: the message names the pip install). "
        "A DCP step without a titan commit marker (e.g. torchtitan's) gets every check but the "
        "manifest's sizes and checksums.",
    )
    verify.add_argument("path", help="step directory, checkpoint folder or file")
    verify.add_argument("--json", action="store_true", help="print JSON for scripts")


def _add_diff(commands: argparse._SubParsersAction) -> None:
    diff = _add_command(
        commands,
        "diff",
        help="compare two checkpoints key by key (any formats)",
        description="Keys only on one side, shape/dtype changes and per-tensor max abs and "
        "relative differences. Exit 0 if equal within |a-b| <= atol + rtol*|b| (default: "
        "bit-exact), 1 if different.",
    )
    diff.add_argument("a", help="first checkpoint")
    diff.add_argument("b", help="second checkpoint")
    diff.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    diff.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
    _filters(diff)
    diff.add_argument("--json", action="store_true", help="print JSON for scripts")


def _add_convert(commands: argparse._SubParsersAction) -> None:
    convert = _add_command(
        commands,
        "convert",
        help="convert between DCP, torch.save, safetensors and HF folders",
        description="Stream SRC into DST in another format. DST is written beside itself "
        "under a temporary name and renamed at the end; an existing non-empty DST is refused "
        "unless --overwrite.",
    )
    convert.add_argument("src", help="DCP step, safetensors file/folder, HF folder or torch file")
    convert.add_argument("dst", help="output directory (a file for torch and *.safetensors)")
    convert.add_argument("--to", required=True, choices=TARGETS, help="output format")
    convert.add_argument("--dtype", choices=sorted(_DTYPES), help="cast floating-point tensors")
    convert.add_argument(
        "--model-only",
        action="store_true",
        help="keep only model keys (drop optimizer, dataloader, ...)",
    )
    _filters(convert)
    convert.add_argument(
        "--model",
        help="state-dict adapter for HF (e.g. llama3); to HF, default: the model a titan "
        "checkpoint records",
    )
    convert.add_argument(
        "--flavor",
        help="model flavor for --to hf (e.g. debugmodel, 8B), not needed when SRC records its "
        "model args (titan-train writes them); checked against SRC's tensors, whose vocabulary "
        "is written",
    )
    convert.add_argument(
        "--hf-config",
        metavar="FILE",
        help="a Hugging Face config.json describing the model, instead of --flavor (shapes no "
        "flavor has); to HF it is also the base of the written config.json, from HF it "
        "replaces SRC's",
    )
    convert.add_argument(
        "--rope-scaling",
        choices=ROPE_SCALINGS,
        help="RoPE of the written config.json for a checkpoint that records no model args: "
        "none (plain RoPE, e.g. torchtitan's July 2025 Llama 3) or llama3 (Llama 3.1 "
        "scaling); default: the flavor's, with the assumption printed",
    )
    convert.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file, e.g. 5GB, 500MB (default 5GB)",
    )
    convert.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")
    convert.add_argument("--json", action="store_true", help="print a JSON summary")


def _filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="GLOB",
        help="only keys matching this glob (repeatable)",
    )
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="drop keys matching this glob (repeatable)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``titan-ckpt``; returns the exit status."""
    args = _parser().parse_args(argv)
    _unmap_freed_buffers()
    try:
        status = _COMMANDS[args.command](args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        # The reader of stdout went away (``titan-ckpt inspect ... | head``): stop quietly
        # with status 141 (128 + SIGPIPE, as a program SIGPIPE ends), not with a traceback.
        # Point stdout at /dev/null so that the interpreter's final flush fails no more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (CheckpointFormatError, CheckpointConfigError, FileNotFoundError, LookupError) as error:
        print(f"titan-ckpt: error: {flag_text(str(error))}", file=sys.stderr)
        return 2
    except UnsafeCheckpointError as error:  # refused, not damaged: the message says why
        print(f"titan-ckpt: error: {error}", file=sys.stderr)
        return 1
    except (CheckpointReadError, CheckpointIntegrityError) as error:
        print(f"titan-ckpt: error: {error} (run titan-ckpt verify on it)", file=sys.stderr)
        return 1


def _unmap_freed_buffers() -> None:
    """Give every buffer over 1 MiB its own mapping, unmapped when freed (glibc; elsewhere a
    no-op): glibc's adaptive threshold would keep freed tensors in its heap, so streaming many
    same-sized tensors would grow the resident memory by several tensors no longer held."""
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_mmap_threshold = -3  # malloc.h's M_MMAP_THRESHOLD
    mallopt(ctypes.c_int(m_mmap_threshold), ctypes.c_int(1 << 20))


def _inspect(args: argparse.Namespace) -> int:
    report = inspect_path(args.path, stats=args.stats, trust_pickles=args.trust_pickles)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def _verify(args: argparse.Namespace) -> int:
    report = verify_path(args.path, trust_pickles=args.trust_pickles)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        uncommitted = report.get("uncommitted", False)
        verdict = "OK" if report["ok"] else "UNCOMMITTED" if uncommitted else "DAMAGED"
        print(f"{verdict}: {args.path}")
        for problem in report["problems"]:
            print(f"  {'not loadable' if uncommitted else 'damaged'}: {problem}")
        for note in report["notes"]:
            print(f"  note: {note}")
    return 0 if report["ok"] else 1


def _diff(args: argparse.Namespace) -> int:
    report = diff_paths(
        args.a,
        args.b,
        atol=args.atol,
        rtol=args.rtol,
        include=args.include,
        exclude=args.exclude,
        trust_pickles=args.trust_pickles,
    )
    print(json.dumps(report, indent=2) if args.json else render_diff(report))
    return 0 if report["equal"] else 1


def _convert(args: argparse.Namespace) -> int:
    progress = _Progress() if sys.stderr.isatty() else None
    options = ConvertOptions(
        to=args.to,
        dtype=_DTYPES[args.dtype] if args.dtype else None,
        model_only=args.model_only,
        include=args.include,
        exclude=args.exclude,
        model=args.model,
        flavor=args.flavor,
        hf_config=args.hf_config,
        rope_scaling=args.rope_scaling,
        max_shard_size=parse_size(args.max_shard_size),
        overwrite=args.overwrite,
        trust_pickles=args.trust_pickles,
        on_progress=progress,
        on_note=lambda note: print(f"titan-ckpt convert: {flag_text(note)}", file=sys.stderr),
    )
    summary = convert(args.src, args.dst, options)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"wrote {summary['dst']} ({summary['to']}): {summary['keys']} keys, "
            f"{summary['bytes'] / (1 << 20):.1f} MiB in {summary['seconds']:.2f} s"
        )
    return 0


_OPTION = re.compile(
    # Not inside a word or a path (my_options.to, /data/options.model/x).
    r"(?<![\w.-])options\.(to|dtype|model_only|include|exclude|model|flavor|hf_config|"
    r"rope_scaling|max_shard_size|overwrite|trust_pickles)\b(?!-|/(?!options\.))(?:=('[^']*'|\w+))?"
)


def flag_text(message: str) -> str:
    """A library message in the command's words: ``options.to='hf'`` -> ``--to hf``,
    ``options.hf_config`` -> ``--hf-config``, ``options.overwrite=True`` -> ``--overwrite``."""

    def flag(m: re.Match) -> str:
        name, value = "--" + m.group(1).replace("_", "-"), m.group(2)
        if value is None or value == "True":
            return name
        return f"{name} {value.strip(chr(39))}"

    return _OPTION.sub(flag, message)


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB``, ``1000`` -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}  # fmt: skip
    t = text.strip().upper()
    number = t.rstrip("KMGTIB")
    unit = t[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1
    if unit not in units or value <= 0:
        raise CheckpointConfigError(
            f"--max-shard-size {text!r}: give a size such as 5GB, 500MB or 2GiB."
        )
    return int(value * units[unit])


class _Progress:
    """Prints ``convert``'s progress on one line of stderr (a terminal)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.finished = False

    def __call__(self, done: int, total: int) -> None:
        if self.finished:
            return
        rate = done / max(time.perf_counter() - self.started, 1e-9) / (1 << 20)
        sys.stderr.write(
            f"\rconverting: {100 * done / total:5.1f}% "
            f"({done / (1 << 20):.0f}/{total / (1 << 20):.0f} MiB, {rate:.0f} MiB/s)"
        )
        if done >= total:
            sys.stderr.write("\n")
            self.finished = True
        sys.stderr.flush()


_COMMANDS = {"inspect": _inspect, "verify": _verify, "diff": _diff, "convert": _convert}


if __name__ == "__main__":
    sys.exit(main())
