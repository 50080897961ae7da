"""``titan-ckpt convert`` to and from Hugging Face streams through an adapter that streams:
its peak memory is about one tensor, not the model.

The input is a 176 MiB DCP checkpoint of a Llama-shaped model (hidden 1024, 8 heads, 6
layers, vocab 1024): 44 tensors of 4 MiB plus norms. It goes DCP -> HF (sharded at 64 MB)
-> DCP through ``test-llama-streaming`` (workers/llama_adapters.py, installed through a
real entry point), which permutes the q/k rows of every layer: each of those outputs is a
new 4 MiB tensor. Each conversion runs as the real command in a fresh interpreter that
reports its peak resident memory (``VmHWM``) after converting a tiny model of the same
kind (the warm baseline: modules and one-time setup, no data) and after the big one; the
growth must stay under 2x the largest tensor plus ``SLACK`` (test_convert_memory.py says
what SLACK covers). Holding the model would grow by its 176 MiB. Both ends are bit-exact.
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
pytest.importorskip("safetensors")

CHILD = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
from titan_ckpt.cli import main

def peak():
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("VmHWM:")).split()[1]) * 1024

tiny, big = json.loads(sys.argv[1])
assert main(tiny) == 0, tiny
warm = peak()
assert main(big) == 0, big
print("PEAKS", json.dumps([warm, peak()]))
"""


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


def peaks(site, tiny: list, big: list) -> tuple[int, int]:
    argv = [sys.executable, "-c", CHILD, json.dumps([list(map(str, tiny)), list(map(str, big))])]
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tuple(json.loads(proc.stdout.split("PEAKS ", 1)[1]))


def test_hf_convert_peak_memory_is_about_one_tensor(
    tmp_path, install_adapters, titan_ckpt, capsys, request
):
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
        warm, peak = peaks(install_adapters, tiny_run, big_run)
        growth[name] = round((peak - warm) / MIB, 1)
    if request.config.getoption("capture") == "no":  # pytest -s: show the measurement
        with capsys.disabled():
            print("peak memory growth of titan-ckpt convert via HF (MiB):", growth)
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
