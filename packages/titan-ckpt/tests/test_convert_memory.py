"""``titan-ckpt convert`` streams: its peak memory is about one tensor, not the checkpoint.

The input is a 256 MiB DCP checkpoint of 64 tensors of 4 MiB (plus small vectors and a train
state). Each conversion runs as the real command in a fresh interpreter, which reports its
peak resident memory (``VmHWM``) at three points:

- after importing torch and titan_ckpt: the interpreter's baseline, reported;
- after converting a tiny checkpoint of the same formats: the baseline the bound is taken
  from, which adds the modules and one-time setup each path loads (FakeTensorMode for
  torch.save output, DCP's planner) but no data;
- after converting the 256 MiB checkpoint.

The growth in the last step must stay under 2x the largest tensor plus ``SLACK``. SLACK
covers what is not tensor data: DCP's metadata and plan for ~130 keys, the safetensors
header, the pickle of a torch.save file, and the 1 MiB hashing buffer of the commit. A
conversion that held the state would grow by the checkpoint's 256 MiB. Measured on the
development machine: 3-4.5 MiB of growth for every path (about one 4 MiB tensor).

The chain covers every reader and writer that streams: DCP -> torch.save -> DCP and
DCP -> safetensors -> DCP, two conversions at a time, and both ends are bit-exact.

Hugging Face conversions stream through an adapter that streams. Their input is a 176 MiB
DCP checkpoint of a Llama-shaped model (hidden 1024, 8 heads, 6 layers, vocab 1024): 44
tensors of 4 MiB plus norms. It goes DCP -> HF (sharded at 64 MB) -> DCP through
``test-llama-streaming`` (workers/llama_adapters.py, installed through a real entry point),
which permutes the q/k rows of every layer: each of those outputs is a new 4 MiB tensor.
The same bound applies; holding the model would grow by its 176 MiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

MIB = 1 << 20
LARGEST = 4 * MIB
SLACK = 8 * MIB

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc"
)

CHILD = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
from titan_ckpt.commands.cli import main

def peak():
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("VmHWM:")).split()[1]) * 1024

tiny, big = json.loads(sys.argv[1])
imported = peak()
assert main(tiny) == 0, tiny
warm = peak()
assert main(big) == 0, big
print("PEAKS", json.dumps([imported, warm, peak()]))
"""


def make_dcp(path, layers: int, numel: int) -> None:
    import torch.distributed.checkpoint as dcp

    state: dict[str, object] = {}
    for i in range(layers):
        state[f"layers.{i}.w"] = torch.arange(numel, dtype=torch.float32) + i
        state[f"layers.{i}.b"] = torch.full((64,), float(i))
    state["train_state"] = {"step": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def start(tiny: list, big: list, site=None) -> subprocess.Popen:
    """The child converting ``tiny`` then ``big``; ``site`` joins its PYTHONPATH (adapters
    installed for the test)."""
    argv = [sys.executable, "-c", CHILD, json.dumps([list(map(str, tiny)), list(map(str, big))])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def finish(proc: subprocess.Popen) -> tuple[int, int, int]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return tuple(json.loads(out.split("PEAKS ", 1)[1]))


@pytest.mark.slow
def test_convert_peak_memory_is_about_one_tensor(tmp_path, titan_ckpt):
    big, tiny = tmp_path / "big", tmp_path / "tiny"
    make_dcp(big, layers=64, numel=LARGEST // 4)
    make_dcp(tiny, layers=2, numel=16)
    # Tiny inputs in the other formats, for the warm-up runs.
    assert titan_ckpt("convert", tiny, tmp_path / "tiny.pt", "--to", "torch")[0] == 0
    assert titan_ckpt("convert", tiny, tmp_path / "tiny-st", "--to", "safetensors")[0] == 0

    phases = [  # (source, tiny source of its format, output, --to); a phase runs at once
        [(big, tiny, "big.pt", "torch"), (big, tiny, "st", "safetensors")],
        [
            (tmp_path / "big.pt", tmp_path / "tiny.pt", "from-torch", "dcp"),
            (tmp_path / "st", tmp_path / "tiny-st", "from-st", "dcp"),
        ],
    ]
    peaks = {}
    for phase in phases:
        running = [
            (f"{src.name} -> {to}", start(
                ["convert", tiny_src, tmp_path / f"warm-{dst}", "--to", to],
                ["convert", src, tmp_path / dst, "--to", to],
            ))
            for src, tiny_src, dst, to in phase
        ]  # fmt: skip
        for name, proc in running:
            peaks[name] = finish(proc)

    report = {
        name: {
            "import_baseline_mib": round(imported / MIB, 1),
            "warm_baseline_mib": round(warm / MIB, 1),
            "growth_mib": round((peak - warm) / MIB, 1),
        }
        for name, (imported, warm, peak) in peaks.items()
    }
    print("peak memory of titan-ckpt convert:", json.dumps(report, indent=1))  # pytest -s
    for name, (_, warm, peak) in peaks.items():
        assert peak - warm <= 2 * LARGEST + SLACK, (name, report)

    for out in ("from-torch", "from-st"):
        code, stdout, _ = titan_ckpt("diff", big, tmp_path / out)
        assert code == 0, stdout
        assert "compared 128 tensors and 1 other values" in stdout


def llama(path, *, dim: int, layers: int, vocab: int, heads: int) -> dict:
    """A DCP step of a Llama in titan names (random weights); returns its HF config."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    state = {
        "tok_embeddings.weight": torch.randn(vocab, dim, generator=g),
        "norm.weight": torch.rand(dim, generator=g),
        "output.weight": torch.randn(vocab, dim, generator=g),
    }
    for i in range(layers):
        for name in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                     "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):  # fmt: skip
            state[f"layers.{i}.{name}.weight"] = torch.randn(dim, dim, generator=g)
        state[f"layers.{i}.attention_norm.weight"] = torch.rand(dim, generator=g)
        state[f"layers.{i}.ffn_norm.weight"] = torch.rand(dim, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return {
        "hidden_size": dim,
        "intermediate_size": dim,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "vocab_size": vocab,
    }


@pytest.mark.slow
def test_hf_convert_peak_memory_is_about_one_tensor(tmp_path, install_adapters, titan_ckpt):
    pytest.importorskip("safetensors")
    big, tiny = tmp_path / "big", tmp_path / "tiny"
    config = llama(big, dim=1024, layers=6, vocab=1024, heads=8)
    tiny_config = llama(tiny, dim=16, layers=2, vocab=32, heads=2)
    for name, c in (("big.json", config), ("tiny.json", tiny_config)):
        (tmp_path / name).write_text(json.dumps(c))
    model = ("--model", "test-llama-streaming")

    def convert(src, dst, to, config_file):
        return ["convert", src, tmp_path / dst, "--to", to, *model, "--hf-config", config_file]

    growth = {}
    for name, tiny_run, big_run in [
        ("dcp -> hf",
         convert(tiny, "tiny-hf", "hf", tmp_path / "tiny.json"),
         [*convert(big, "hf", "hf", tmp_path / "big.json"), "--max-shard-size", "64MB"]),
        ("hf -> dcp",
         convert(tmp_path / "tiny-hf", "tiny-back", "dcp", tmp_path / "tiny.json"),
         convert(tmp_path / "hf", "back", "dcp", tmp_path / "big.json")),
    ]:  # fmt: skip
        _, warm, peak = finish(start(tiny_run, big_run, site=install_adapters))
        growth[name] = round((peak - warm) / MIB, 1)
    print("peak memory growth of titan-ckpt convert via HF (MiB):", growth)  # pytest -s
    for name, mib in growth.items():
        assert mib * MIB <= 2 * LARGEST + SLACK, (name, growth)

    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == 3 + 6 * 9
    assert index["metadata"]["total_size"] == (2 * 1024 + 6 * 7 * 1024 + 6 * 2 + 1) * 1024 * 4
    code, out, _ = titan_ckpt("diff", big, tmp_path / "back")
    assert code == 0, out
    assert "compared 57 tensors" in out
