"""``titan-ckpt convert`` across packages: a titan Llama 3 checkpoint (written by
CheckpointManager) converted with ``--to hf --model llama3`` loads in transformers'
``LlamaForCausalLM.from_pretrained`` and gives titan's logits within fp32 tolerance; and
DCP -> HF -> DCP returns the model bit-exact, by ``titan-ckpt diff``'s verdict.

Needs titan-ckpt, titan-models (the ``llama3`` adapter entry point) and transformers; no
download (the model is built from the flavor, the HF side from the written folder).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
titan_models = pytest.importorskip("titan_models")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FLAVOR = "debugmodel"  # dim 256, 6 layers, 16 heads, vocab 2048: ~6M parameters


def titan_ckpt(*args: object) -> subprocess.CompletedProcess:
    """The command as a user runs it (``python -m`` runs the console script's function)."""
    cmd = [sys.executable, "-m", "titan_ckpt.commands.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def run_in_process(capsys, *args: object) -> tuple[int, str]:
    """``titan-ckpt ARGS`` in this process (saves a torch import per call)."""
    from titan_ckpt.commands.cli import main

    code = main([str(a) for a in args])
    return code, capsys.readouterr().out


class TrainState:
    def __init__(self) -> None:
        self.step = 7

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step = sd["step"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A titan Llama 3 (debugmodel) and the DCP step CheckpointManager wrote for it."""
    from titan_ckpt import CheckpointConfig, CheckpointManager

    torch.manual_seed(0)
    model = titan_models.llama3.Llama3(titan_models.llama3.llama3_args(FLAVOR))
    model.init_weights()
    folder = tmp_path_factory.mktemp("llama") / "ckpt"
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(folder), interval=1),
        model_parts=[model],
        states={"train_state": TrainState()},
    )
    manager.save(7)
    manager.close()
    return model.eval(), folder / "step-7"


@pytest.fixture(scope="module")
def hf_folder(saved, tmp_path_factory):
    """The HF export, made by the installed command in its own process."""
    hf = tmp_path_factory.mktemp("hf") / "hf"
    proc = titan_ckpt("convert", saved[1], hf, "--to", "hf", "--model", "llama3",
                      "--flavor", FLAVOR)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return hf


def test_hf_export_loads_in_transformers_with_equal_logits(saved, hf_folder):
    model, _ = saved
    hf = hf_folder
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((hf / "config.json").read_text())["num_hidden_layers"] == 6
    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(hf)).eval()
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf_model(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_dcp_hf_dcp_is_bit_exact(saved, hf_folder, tmp_path, capsys):
    _, step = saved
    back = tmp_path / "back"
    # Back through the adapter, which reads the head counts from the folder's config.json.
    code, _ = run_in_process(capsys, "convert", hf_folder, back, "--to", "dcp", "--model", "llama3")
    assert code == 0
    code, out = run_in_process(capsys, "diff", step, back, "--json")
    assert code == 1
    report = json.loads(out)
    # HF holds the model only: the train state is the one difference, and no tensor differs.
    assert report["only_in_a"] == ["train_state.step"]
    assert report["only_in_b"] == []
    assert report["different"] == []
    assert report["shape_or_dtype"] == []
    assert report["compared"]["tensors"] == len(saved[0].state_dict())
    code, out = run_in_process(capsys, "diff", step, back, "--exclude", "train_state.*")
    assert code == 0, out
