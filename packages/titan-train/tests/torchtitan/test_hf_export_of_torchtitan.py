"""A torchtitan (July 2025) checkpoint, exported with ``titan-ckpt convert --to hf``, gives
torchtitan's own logits in ``transformers`` when ``--rope-scaling none`` says its RoPE was plain.

Checked against ``data/logits.pt``: the logits torchtitan 6204cdff9's own ``Transformer``
computed from the recorded ``step-4`` weights (``tools/torchtitan_reference/record_logits.py``)
on 1,024 tokens, first and last 8 positions. The shape is described to convert as a user
would, by an HF Llama 3.x ``config.json`` (which says Llama 3.1 RoPE scaling); the checkpoint
records no model args. Without the flag the export keeps that scaling, and the logits far
into the sequence move away from torchtitan's: the control that shows the flag matters.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from titan_ckpt.commands.cli import main as titan_ckpt  # noqa: E402

DATA = Path(__file__).parent / "data"
META = json.loads((DATA / "reference.json").read_text())
STEP = DATA / "checkpoint" / f"step-{META['checkpoint_step']}"
EQUAL = 2e-6  # fp32: measured 2.4e-7 between torchtitan's and transformers' RoPE arithmetic
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.fixture(scope="module")
def torchtitans() -> dict:
    return torch.load(DATA / "logits.pt", weights_only=True)


def llama3_config(form: str) -> dict:
    """The tiny shape as an HF Llama 3.1 config.json: as transformers 5 writes it
    (``rope_parameters``) or in the older form (``rope_scaling`` only)."""
    model = META["model"]
    config = transformers.LlamaConfig(
        hidden_size=model["dim"],
        num_hidden_layers=model["n_layers"],
        num_attention_heads=model["n_heads"],
        num_key_value_heads=model["n_kv_heads"],
        intermediate_size=96,  # torchtitan's FFN size for dim 32, multiple_of 32
        vocab_size=model["vocab_size"],
        max_position_embeddings=131072,
        rope_theta=model["rope_theta"],
        rms_norm_eps=1e-5,  # torchtitan's norm_eps (LlamaConfig's default is 1e-6)
        rope_scaling=dict(LLAMA31_ROPE),
        tie_word_embeddings=False,
    ).to_dict()
    if form == "rope_scaling":
        config.pop("rope_parameters", None)
        config["rope_scaling"] = dict(LLAMA31_ROPE)
        config["rope_theta"] = model["rope_theta"]
    return config


def export(tmp_path: Path, config: dict, *flags: str) -> Path:
    described = tmp_path / "llama31-config.json"
    described.write_text(json.dumps(config))
    out = tmp_path / ("hf" + "".join(flags).replace("-", "_"))
    args = ["convert", str(STEP), str(out), "--to", "hf", "--model", "llama3"]
    code = titan_ckpt([*args, "--hf-config", str(described), *flags])
    assert code == 0
    return out


def hf_logits(folder: Path, torchtitans: dict) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torchtitans["inputs"]).logits[:, torchtitans["positions"]]


def digest(folder: Path) -> dict[str, str]:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.mark.parametrize("form", ["rope_parameters", "rope_scaling"])
def test_rope_scaling_none_reproduces_torchtitans_logits(tmp_path, torchtitans, form):
    before = digest(STEP)
    plain = export(tmp_path, llama3_config(form), "--rope-scaling", "none")
    written = json.loads((plain / "config.json").read_text())
    assert written["rope_scaling"] is None
    assert written.get("rope_parameters", {}).get("rope_type", "default") == "default"

    got = hf_logits(plain, torchtitans)
    assert got.shape == torchtitans["logits"].shape == (1, 16, META["model"]["vocab_size"])
    worst = float((got - torchtitans["logits"]).abs().max())
    assert worst <= EQUAL, f"max |HF - torchtitan| = {worst:.2e}"
    assert digest(STEP) == before  # the torchtitan checkpoint is only read


def test_without_the_flag_the_scaled_rope_moves_far_positions(tmp_path, torchtitans):
    scaled = export(tmp_path, llama3_config("rope_parameters"))
    assert json.loads((scaled / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    diff = (hf_logits(scaled, torchtitans) - torchtitans["logits"]).abs().amax(-1)[0]
    far = torchtitans["positions"] >= 1000
    assert far.sum() == 8
    assert float(diff[far].min()) > 5 * EQUAL  # measured: 2e-5 and more near position 1,016
    assert float(diff[~far].max()) < float(diff[far].min())  # the drift grows with position
