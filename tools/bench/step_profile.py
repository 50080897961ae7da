"""Where a training step's time goes: one step of the Llama 3 debug model (batch 8 x seq
2048, fp32, no activation checkpointing: the side-by-side setting) under torch's profiler,
its operators' own time split into matmuls, attention, the loss over the vocabulary, the
optimizer, the elementwise rest (norms, SwiGLU, RoPE, residual adds) and memory fills; with
the step's minor page faults, once with titan's host-memory reuse and once with glibc's
defaults (each in its own process: the setting is process-wide).

    python tools/bench/step_profile.py                    # both, ~2 minutes on 2 cores
    python tools/bench/step_profile.py --reuse on --batch 2 --json

The last line of the table is the bound the split puts on any speed-up that leaves the
matmul and attention kernels as they are (torchtitan runs the same kernels, torch's MKL
matmuls and its CPU flash attention): step time / (matmul + attention time).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

CATEGORIES = ("matmul", "attention", "loss", "optimizer", "elementwise", "fill/copy", "other")
# The fused RMSNorm's row sums are one-column matmuls (aten::mm, well under 1% of the step):
# they count here, so the bound below is, if anything, slightly low.
_MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm"}
_LOSS = ("log_softmax", "nll_loss")
_ELEMENTWISE = (
    "mul", "add", "sub", "div", "pow", "rsqrt", "mean", "sum", "silu", "neg", "exp",
    "view_as", "where", "embedding", "sqrt", "lerp", "addc", "linalg_vector_norm",
)  # fmt: skip
_FILL = ("fill_", "zero_", "copy_", "clone", "contiguous", "_to_copy", "cat", "empty")


def category(name: str, in_optimizer: bool) -> str:
    """The category of an operator's own time (``in_optimizer``: it ran inside the
    optimizer's step)."""
    if in_optimizer:
        return "optimizer"
    if name in _MATMUL:
        return "matmul"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if any(key in name for key in _LOSS):
        return "loss"
    op = name.removeprefix("aten::")
    if any(op.startswith(key) for key in _FILL):
        return "fill/copy"
    if any(op.startswith(key) for key in _ELEMENTWISE):
        return "elementwise"
    return "other"


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def profile_step(batch: int, seq: int, reuse: bool, steps: int) -> dict:
    """Build the model, run ``steps`` timed steps (after one warm-up), profile one more;
    the split of the profiled step, the timed steps' median and their page faults."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from titan_models.llama3 import llama3_args
    from titan_models.llama3.model import Llama3
    from titan_train.trainer.host_memory import reuse_host_memory
    from titan_train.trainer.step import cross_entropy_loss

    applied = reuse_host_memory() if reuse else False
    torch.manual_seed(0)
    model = Llama3(llama3_args("debugmodel", vocab_size=2048, max_seq_len=seq))
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4, foreach=True)
    tokens = torch.randint(0, 2048, (batch, seq + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        loss = cross_entropy_loss(model(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    step()
    times, faults = [], []
    for _ in range(steps):
        before, started = _minor_faults(), time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
        faults.append(_minor_faults() - before)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    split = dict.fromkeys(CATEGORIES, 0.0)
    for event in prof.events():
        parent, in_optimizer = event.cpu_parent, False
        while parent is not None:
            in_optimizer |= parent.name.startswith("Optimizer.step")
            parent = parent.cpu_parent
        if event.name.startswith(("Optimizer.step", "autograd::", "ProfilerStep")):
            continue
        split[category(event.name, in_optimizer)] += event.self_cpu_time_total / 1e6
    return {
        "reuse_host_memory": applied,
        "threads": torch.get_num_threads(),
        "step_s": sorted(times)[len(times) // 2],
        "step_s_all": times,
        "page_faults_per_step": sorted(faults)[len(faults) // 2],
        "split_s": split,
    }


def _child(args: argparse.Namespace, reuse: str) -> dict:
    command = [
        sys.executable, __file__, "--reuse", reuse, "--json",
        "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
    if out.returncode != 0:
        raise SystemExit(f"step_profile: the {reuse} run failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(results: dict[str, dict]) -> str:
    names = list(results)
    lines = [f"{'':24}" + "".join(f"{'reuse ' + n:>22}" for n in names)]
    lines.append(
        f"{'step s (median)':24}" + "".join(f"{r['step_s']:>22.3f}" for r in results.values())
    )
    lines.append(
        f"{'page faults per step':24}"
        + "".join(f"{r['page_faults_per_step']:>22,}" for r in results.values())
    )
    for cat in CATEGORIES:
        cells = []
        for r in results.values():
            total = sum(r["split_s"].values())
            cells.append(f"{r['split_s'][cat]:9.3f} s {100 * r['split_s'][cat] / total:5.1f}%")
        lines.append(f"{cat:24}" + "".join(f"{c:>22}" for c in cells))
    bounds = []
    for r in results.values():
        split = r["split_s"]
        bounds.append(sum(split.values()) / (split["matmul"] + split["attention"]))
    lines.append(f"{'bound (step/(mm+attn))':24}" + "".join(f"{b:>21.2f}x" for b in bounds))
    if len(names) == 2:
        a, b = results["off"]["step_s"], results["on"]["step_s"]
        lines.append(f"host-memory reuse: step time on/off = {b / a:.3f} (same run, both children)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reuse", choices=("on", "off", "both"), default="both",
                        help="host-memory reuse (titan's default: on); both runs each")  # fmt: skip
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3, help="timed steps before the profiled one")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    if args.reuse == "both":
        results = {"off": _child(args, "off"), "on": _child(args, "on")}
    else:
        results = {args.reuse: profile_step(args.batch, args.seq, args.reuse == "on", args.steps)}
    print(json.dumps(results[args.reuse]) if args.json and len(results) == 1 else report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
