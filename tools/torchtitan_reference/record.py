"""Record, once, what torchtitan (July 2025, commit 6204cdff9) itself writes and computes.

Runs torchtitan's own trainer on CPU through the runtime shim of
``shared/anchors/torchtitan-cpu/`` (no torchtitan source is edited) and keeps, as small test
data for titan's "resume from torchtitan" tests:

- ``checkpoint/step-N/``: torchtitan's full-state checkpoint at step N (> warmup): model,
  optimizer, lr_scheduler, dataloader, train_state, exactly as torchtitan wrote it;
- ``reference.pt``: the batch torchtitan trained on at step N + 1 (token ids and labels),
  its loss on that batch (computed from the step-N weights), the learning rate of every step,
  and the model's weights after the optimizer step N + 1;
- ``reference.json``: the shape, schedule and optimizer settings of the run, the losses and
  learning rates of every step, and where the data came from;
- ``logits.pt``: torchtitan's logits from the step-N weights (``record_logits.py``).

The model is a tiny Llama 3 (``tt_tiny``, added to torchtitan's flavor registry at run time)
with plain RoPE (torchtitan's July 2025 Llama 3 has no frequency scaling) and a vocabulary of
2,048 rows, the size of titan-train's shipped tokenizer, so titan-train builds the same shape
with its default tokenizer. The token ids come from torchtitan's own tokenizer and data; the
numeric checks use the recorded ids, not a tokenizer.

Usage (see README.md next to this file)::

    TT_VENV/bin/python tools/torchtitan_reference/record.py \
        --torchtitan TT_DIR --shim shared/anchors/torchtitan-cpu/tt_cpu_launch.py \
        --out packages/titan-train/tests/torchtitan/data
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TORCHTITAN_COMMIT = "6204cdff9"
FLAVOR = "tt_tiny"
SHAPE = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32}
ROPE_THETA = 500000.0
VOCAB_SIZE = 2048
SEQ_LEN = 32
BATCH = 2
STEPS = 10
WARMUP = 2
DECAY_RATIO = 0.5
CHECKPOINT_STEP = 4  # saved by interval; step 5 is the "next step" we record
LR = 8e-4
SEED = 0


def torchtitan_args(dump_folder: str) -> list[str]:
    """torchtitan's command line: its own debug TOML plus overrides for the tiny run."""
    return [
        "--job.config_file", "torchtitan/models/llama3/train_configs/debug_model.toml",
        "--job.dump_folder", dump_folder,
        "--model.flavor", FLAVOR,
        "--training.local_batch_size", str(BATCH),
        "--training.seq_len", str(SEQ_LEN),
        "--training.steps", str(STEPS),
        "--training.seed", str(SEED),
        "--training.mixed_precision_param", "float32",
        "--lr_scheduler.warmup_steps", str(WARMUP),
        "--lr_scheduler.decay_ratio", str(DECAY_RATIO),
        "--optimizer.lr", str(LR),
        "--activation_checkpoint.mode", "none",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval", str(CHECKPOINT_STEP),
        "--checkpoint.keep_latest_k", "0",
        "--metrics.log_freq", "1",
    ]  # fmt: skip


# ---------------------------------------------------------------------------- child process
def _install_hooks(captured: dict, out: Path) -> None:
    """Add the tiny flavor and capture hooks; runs after the shim imported torchtitan."""
    import dataclasses

    import torch
    import torch.nn.functional as functional
    from torchtitan.components import lr_scheduler as tt_lr
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_configs
    from torchtitan.models.llama3.model.model import Transformer

    @dataclasses.dataclass
    class FixedVocabArgs(TransformerModelArgs):
        # torchtitan sizes the vocabulary from its tokenizer (about 2,000 ids); titan-train's
        # shipped tokenizer has 2,048, so the tiny model keeps 2,048 rows on both sides.
        def update_from_config(self, job_config, tokenizer) -> None:
            super().update_from_config(job_config, tokenizer)
            if tokenizer.get_vocab_size() > VOCAB_SIZE:
                raise SystemExit(f"tokenizer has {tokenizer.get_vocab_size()} > {VOCAB_SIZE} ids")
            self.vocab_size = VOCAB_SIZE

    llama3_configs[FLAVOR] = FixedVocabArgs(**SHAPE, rope_theta=ROPE_THETA)

    schedulers: list = []
    init = tt_lr.LRSchedulersContainer.__init__

    def remember_schedulers(self, *args, **kwargs):
        init(self, *args, **kwargs)
        schedulers.append(self)

    tt_lr.LRSchedulersContainer.__init__ = remember_schedulers

    forward = Transformer.forward

    def recording_forward(self, tokens, *args, **kwargs):
        if self.training:
            step = captured["steps"] = captured.get("steps", 0) + 1
            captured["lrs"].append(schedulers[0].schedulers[0].get_last_lr()[0])
            if step == CHECKPOINT_STEP + 1:
                captured["inputs"] = tokens.detach().clone()
            if step == CHECKPOINT_STEP + 2:
                # The weights now are those after the optimizer step of step N + 1.
                captured["weights_after"] = {
                    k: v.detach().clone() for k, v in self.state_dict().items() if k != "freqs_cis"
                }
                _write_reference(captured, out)
        return forward(self, tokens, *args, **kwargs)

    Transformer.forward = recording_forward

    cross_entropy = functional.cross_entropy

    def recording_cross_entropy(input, target, *args, **kwargs):
        loss = cross_entropy(input, target, *args, **kwargs)
        captured["losses"].append(float(loss.detach()))
        if captured.get("steps") == CHECKPOINT_STEP + 1 and "labels" not in captured:
            captured["labels"] = target.detach().clone().view(BATCH, SEQ_LEN)
            captured["loss"] = loss.detach().clone()
        return loss

    torch.nn.functional.cross_entropy = recording_cross_entropy


def _write_reference(captured: dict, out: Path) -> None:
    import torch

    torch.save(
        {
            "inputs": captured["inputs"],
            "labels": captured["labels"],
            "loss": captured["loss"],
            "lr_next_step": captured["lrs"][CHECKPOINT_STEP],
            "weights_after": captured["weights_after"],
        },
        out / "reference.pt",
    )


def child(shim: str, out: Path, dump_folder: str) -> None:
    """Run torchtitan's trainer (through the shim) with the hooks installed."""
    captured: dict = {"lrs": [], "losses": []}
    run_module = runpy.run_module

    def run_with_hooks(name, *args, **kwargs):
        _install_hooks(captured, out)
        return run_module(name, *args, **kwargs)

    runpy.run_module = run_with_hooks
    sys.argv = [shim, *torchtitan_args(dump_folder)]
    try:
        runpy.run_path(shim, run_name="__main__")
    finally:
        (out / "steps.json").write_text(
            json.dumps({"lrs": captured["lrs"], "losses": captured["losses"]})
        )


# --------------------------------------------------------------------------- parent process
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torchtitan", required=True, help="extracted torchtitan checkout")
    parser.add_argument("--shim", required=True, help="path to tt_cpu_launch.py")
    parser.add_argument("--out", required=True, help="folder for the recorded data")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dump-folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out).resolve()
    if args.child:
        child(str(Path(args.shim).resolve()), out, args.dump_folder)
        return

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "outputs"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--child",
                "--torchtitan",
                args.torchtitan,
                "--shim",
                args.shim,
                "--out",
                str(out),
                "--dump-folder",
                str(dump),
            ],
            cwd=args.torchtitan,
            env=env,
            check=True,
        )
        target = out / "checkpoint" / f"step-{CHECKPOINT_STEP}"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(dump / "checkpoint" / f"step-{CHECKPOINT_STEP}", target)
    steps = json.loads((out / "steps.json").read_text())
    (out / "steps.json").unlink()
    meta = {
        "torchtitan_commit": TORCHTITAN_COMMIT,
        "recorded_by": "tools/torchtitan_reference/record.py",
        "model": {**SHAPE, "vocab_size": VOCAB_SIZE, "rope_theta": ROPE_THETA, "rope": "plain"},
        "training": {"local_batch_size": BATCH, "seq_len": SEQ_LEN, "steps": STEPS, "seed": SEED},
        "optimizer": {
            "name": "AdamW",
            "lr": LR,
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "weight_decay": 0.1,
            "max_norm": 1.0,
        },
        "lr_scheduler": {
            "warmup_steps": WARMUP,
            "decay_ratio": DECAY_RATIO,
            "decay_type": "linear",
            "lr_min": 0.0,
        },
        "checkpoint_step": CHECKPOINT_STEP,
        "lrs": steps["lrs"],
        "losses": steps["losses"],
    }
    (out / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    logits = Path(__file__).resolve().with_name("record_logits.py")
    subprocess.run(
        [sys.executable, str(logits), "--torchtitan", args.torchtitan, "--data", str(out)],
        env=env,
        check=True,
    )
    print(f"recorded into {out}")


if __name__ == "__main__":
    main()
