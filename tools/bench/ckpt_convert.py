"""``titan-ckpt convert`` DCP -> safetensors: throughput and peak memory, against a raw copy
of the same bytes and torch's ``dcp_to_torch_save``, all in one run on the same input.

Writes a DCP checkpoint of about ``--size-gb`` GB (fp32: one embedding-like tensor of 1/8 of
the total, the rest 16 MiB matrices with small vectors between them), then, each in a fresh
process so its peak RSS (``wait4``'s ru_maxrss) is its own:

- raw: copy the DCP files to a new folder through user space (read, write in 16 MiB chunks,
  fsync), as any converter must move the bytes; ``shutil.copyfile`` would use
  ``copy_file_range``, which some filesystems serve without moving data;
- titan-ckpt: ``titan-ckpt convert SRC DST --to safetensors`` (index + shards of 5 GB);
- dcp_to_torch_save: torch's one-call conversion to a torch.save file;
- baseline: a process that only imports torch and titan_ckpt (the RSS floor).

Seconds count the work only, after each process's imports (torch's import alone takes
seconds on a small machine).

    python tools/bench/ckpt_convert.py                       # 2 GB in a temporary folder
    python tools/bench/ckpt_convert.py --size-gb 0.5 --dir /tmp/ckpt-convert-bench

Goals (issue 5): titan-ckpt throughput >= 70% of raw; peak RSS above the baseline < 2x the
largest tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

MIB = 1 << 20


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size (default 2 GB)")
    p.add_argument(
        "--dir",
        default=None,
        help="where to write: a new temporary folder is made inside it (default: in the "
        "system's temporary directory), and only that folder is removed afterwards",
    )
    p.add_argument("--keep", action="store_true", help="keep the files afterwards")
    return p.parse_args()


def make_checkpoint(path: str, size_bytes: int) -> tuple[int, int]:
    """Write the DCP input; returns (tensor bytes, largest tensor bytes)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    state: dict[str, object] = {}
    embed_rows = max(size_bytes // 8 // (2048 * 4), 1)
    state["tok_embeddings.weight"] = torch.randn(embed_rows, 2048, generator=g)
    left = size_bytes - embed_rows * 2048 * 4
    i = 0
    while left > 0:
        state[f"layers.{i}.w"] = torch.randn(2048, 2048, generator=g)  # 16 MiB
        state[f"layers.{i}.norm"] = torch.ones(2048)
        left -= 16 * MIB + 2048 * 4
        i += 1
    state["train_state"] = {"step": 1000}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.nbytes for t in tensors), max(t.nbytes for t in tensors)


def timed_child(code: str) -> tuple[float, int]:
    """Run ``code`` in a fresh interpreter after its imports; returns (seconds of the work,
    peak RSS bytes). The peak is the child's own VmHWM: ``wait4``'s ru_maxrss would carry the
    parent's high-water mark across fork and exec."""
    imports, work = code.split("\n---\n")
    wrapped = (
        f"{imports}\nimport json, time\nt0 = time.perf_counter()\n{work}\n"
        "seconds = time.perf_counter() - t0\n"
        "hwm = open('/proc/self/status').read().split('VmHWM:')[1].split()[0]\n"
        "print('RESULT', json.dumps([seconds, int(hwm) * 1024]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", wrapped], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child failed:\n{wrapped}\n{proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    seconds, rss = json.loads(line.split(" ", 1)[1])
    return seconds, rss


RAW = """import os
---
src, dst = {src!r}, {dst!r}
os.makedirs(dst)
for name in os.listdir(src):
    with open(os.path.join(src, name), "rb") as s, open(os.path.join(dst, name), "wb") as d:
        while chunk := s.read(16 << 20):
            d.write(chunk)
        d.flush()
        os.fsync(d.fileno())"""
TITAN = """from titan_ckpt.commands.cli import main
---
assert main(['convert', {src!r}, {dst!r}, '--to', 'safetensors']) == 0"""
TORCH = """import os, warnings
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
warnings.simplefilter('ignore')
---
dcp_to_torch_save({src!r}, {dst!r})
with open({dst!r}, 'rb+') as f:
    os.fsync(f.fileno())"""
BASELINE = """import torch, torch.distributed.checkpoint, titan_ckpt.commands.cli
---
pass"""


def main() -> None:
    args = parse()
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    # Always a folder of our own: --keep aside, it is removed afterwards, with nothing else.
    root = tempfile.mkdtemp(prefix="titan-ckpt-convert-bench-", dir=args.dir)
    src = os.path.join(root, "dcp")
    try:
        t0 = time.perf_counter()
        total, largest = make_checkpoint(src, int(args.size_gb * 1e9))
        print(f"input: {src}, {total / 1e9:.2f} GB of tensors, largest {largest / MIB:.0f} MiB "
              f"(written in {time.perf_counter() - t0:.1f} s)")  # fmt: skip
        results = {}
        for name, template, out in (
            ("baseline", BASELINE, None),
            ("raw copy", RAW, "raw"),
            ("titan-ckpt convert", TITAN, "st"),
            ("dcp_to_torch_save", TORCH, "torch.pt"),
        ):
            dst = os.path.join(root, out) if out else ""
            seconds, rss = timed_child(template.format(src=src, dst=dst))
            results[name] = {"seconds": seconds, "peak_rss": rss}
            if out:
                shutil.rmtree(dst, ignore_errors=True) if os.path.isdir(dst) else os.remove(dst)
        floor = results["baseline"]["peak_rss"]
        raw_rate = total / results["raw copy"]["seconds"]
        print(f"{'':22}{'seconds':>9}{'GB/s':>8}{'% of raw':>10}{'peak RSS':>11}"
              f"{'- floor':>10}{'x largest':>11}")  # fmt: skip
        for name, r in results.items():
            rate = total / max(r["seconds"], 1e-9) if name != "baseline" else 0
            extra = max(r["peak_rss"] - floor, 0)
            print(
                f"{name:22}{r['seconds']:9.2f}{rate / 1e9:8.2f}"
                f"{100 * rate / raw_rate:9.0f}%{r['peak_rss'] / MIB:8.0f} MiB"
                f"{extra / MIB:6.0f} MiB{extra / largest:10.2f}x"
            )
        titan = results["titan-ckpt convert"]
        summary = {
            "size_bytes": total,
            "largest_tensor_bytes": largest,
            "titan_vs_raw": round(total / titan["seconds"] / raw_rate, 3),
            "titan_rss_over_floor_x_largest": round((titan["peak_rss"] - floor) / largest, 3),
            "results": results,
        }
        print(json.dumps(summary))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
