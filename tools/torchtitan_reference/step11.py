"""Step 11 after torchtitan's own step-10 checkpoint: torchtitan's loss and titan's.

torchtitan (a checkout of its July 2025 commit ``6204cdff9`` and a venv that runs it, on CPU
through ``tt_cpu_launch.py`` next to this file) trains its own ``debug_model.toml`` (its
debug Llama 3, its test tokenizer, its ``c4_test`` data; fp32) for 10 steps and saves a full
checkpoint at step 10. From copies of that checkpoint, torchtitan and titan-train each train
step 11 with the dataloader state not loaded (``--checkpoint.exclude_from_loading
dataloader``: titan cannot read torchtitan's), so both restart the data from its first
document; the script prints both step-11 losses and their difference, and exits 1 when it
is above ``--tolerance``.

titan-train runs the same TOML and command line, plus the two settings that make it train
on what torchtitan's July 2025 run trains on:

- ``--model.rope_scaling none``: torchtitan's Llama 3 of July 2025 has plain RoPE, titan's
  flavors Llama 3.1's scaling (a checkpoint does not say which; titan's resume warns);
- ``--training.data_shards 1``: torchtitan packs one stream of documents in file order, titan
  deals them into 64 virtual shards by default (so a run reads 1/dp of the corpus per rank
  and trains on the same batches at any dp); with one shard, one process trains on
  torchtitan's batches.

Run it with the Python that has titan installed (torchtitan runs in its own venv)::

    python tools/torchtitan_reference/step11.py --torchtitan TT_DIR --venv TT_VENV
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOML = "torchtitan/models/llama3/train_configs/debug_model.toml"
CHECKPOINT_STEP = 10


def common_args(dump_folder: Path, *, seq_len: int, batch: int, steps: int) -> list[str]:
    """The command line torchtitan and titan-train both get (torchtitan's key names)."""
    args = [
        "--job.config_file", TOML,
        "--job.dump_folder", str(dump_folder),
        "--training.mixed_precision_param", "float32",
        "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(batch),
        "--training.steps", str(steps),
        "--training.seed", "0",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval", str(CHECKPOINT_STEP),
    ]  # fmt: skip
    if steps > CHECKPOINT_STEP:
        args += ["--checkpoint.exclude_from_loading", "dataloader"]
    return args


TITAN_ARGS = ["--model.rope_scaling", "none", "--training.data_shards", "1"]


# ---------------------------------------------------------------- child (torchtitan's venv)
def torchtitan_child(losses_file: str, shim: str, argv: list[str]) -> None:
    """Run torchtitan's trainer through the shim, keeping the value of every loss it
    computes (one per step: one process, no gradient accumulation, no validation)."""
    import torch

    losses: list[float] = []
    cross_entropy = torch.nn.functional.cross_entropy

    def recording_cross_entropy(*args, **kwargs):
        loss = cross_entropy(*args, **kwargs)
        losses.append(float(loss.detach()))
        return loss

    # torchtitan's loss calls torch.nn.functional.cross_entropy by attribute at each step.
    torch.nn.functional.cross_entropy = recording_cross_entropy
    sys.argv = [shim, *argv]
    try:
        runpy.run_path(shim, run_name="__main__")
    finally:
        Path(losses_file).write_text(json.dumps(losses))


# ---------------------------------------------------------------------------- parent
def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(command: list[str], cwd: Path, env: dict[str, str], log: Path) -> None:
    with log.open("w") as out:
        done = subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{' '.join(command[:3])} ... failed ({done.returncode}); {log}:\n{tail}")


def run_torchtitan(args, dump: Path, steps: int, env: dict[str, str]) -> list[float]:
    """torchtitan's losses of the steps it trained, in order."""
    losses = dump.parent / f"{dump.name}.losses.json"
    command = [
        str(Path(args.venv) / "bin" / "python"), str(Path(__file__).resolve()),
        "--torchtitan-child", str(losses), args.shim,
        *common_args(dump, seq_len=args.seq_len, batch=args.batch, steps=steps),
    ]  # fmt: skip
    _run(
        command,
        Path(args.torchtitan),
        {**env, "MASTER_PORT": _free_port()},
        dump.parent / f"{dump.name}.log",
    )
    return json.loads(losses.read_text())


def run_titan(args, dump: Path, env: dict[str, str]) -> dict:
    """titan-train's metrics of step 11 (``metrics.jsonl``)."""
    command = [
        sys.executable, "-m", "titan_train.cli",
        *common_args(dump, seq_len=args.seq_len, batch=args.batch, steps=CHECKPOINT_STEP + 1),
        *TITAN_ARGS,
    ]  # fmt: skip
    _run(command, Path(args.torchtitan), env, dump.parent / f"{dump.name}.log")
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return next(row for row in rows if row.get("step") == CHECKPOINT_STEP + 1 and "loss" in row)


def compare(args, work: Path) -> dict:
    """Both step-11 losses: {"torchtitan": ..., "titan": ..., "difference": ...}."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONHASHSEED": "0"}
    first = work / "torchtitan_steps_1_10"
    run_torchtitan(args, first, CHECKPOINT_STEP, env)
    saved = first / "checkpoint" / f"step-{CHECKPOINT_STEP}"
    if not saved.is_dir():
        raise SystemExit(f"torchtitan wrote no {saved}")
    for name in ("torchtitan_step_11", "titan_step_11"):
        shutil.copytree(saved, work / name / "checkpoint" / saved.name)
    tt_loss = run_torchtitan(args, work / "torchtitan_step_11", CHECKPOINT_STEP + 1, env)[-1]
    titan = run_titan(args, work / "titan_step_11", env)
    return {"torchtitan": tt_loss, "titan": titan["loss"], "difference": titan["loss"] - tt_loss}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--torchtitan-child"]:
        torchtitan_child(argv[1], argv[2], argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torchtitan", required=True, help="torchtitan checkout (6204cdff9)")
    parser.add_argument("--venv", required=True, help="a venv that runs torchtitan")
    parser.add_argument("--shim", default=str(HERE / "tt_cpu_launch.py"), help="CPU launcher")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--work", help="keep the runs here (a new folder); default: temporary")
    args = parser.parse_args(argv)
    args.shim = str(Path(args.shim).resolve())
    for path, what in [(Path(args.torchtitan) / TOML, "a torchtitan checkout's debug TOML"),
                       (Path(args.venv) / "bin" / "python", "the venv's python"),
                       (Path(args.shim), "the CPU launcher")]:  # fmt: skip
        if not path.is_file():
            parser.error(f"{path} does not exist; pass {what} (see this script's docstring)")
    if args.work:
        work = Path(args.work).resolve()
        work.mkdir(parents=True)  # a new folder: nothing of the user's is overwritten
        result = compare(args, work)
    else:
        with tempfile.TemporaryDirectory(prefix="step11-") as tmp:
            result = compare(args, Path(tmp))
    print(f"torchtitan step 11 loss: {result['torchtitan']:.8f}")
    print(f"titan      step 11 loss: {result['titan']:.8f}")
    print(
        f"difference (titan - torchtitan): {result['difference']:.3e} "
        f"(tolerance {args.tolerance:g})"
    )
    return 0 if abs(result["difference"]) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
