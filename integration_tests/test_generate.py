"""``titan-train generate`` across packages: a Llama 3 run trained by titan-train, its step
converted by ``titan-ckpt convert --to hf`` (described by the step's model record alone),
and greedy generation from the DCP step, from the HF folder, and from the HF folder in
transformers' ``LlamaForCausalLM.generate``: the same tokens all three ways.

Needs titan-train, titan-ckpt, titan-models and transformers; no download.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

NEW = 8
PROMPTS = ["Once upon a time", "The model"]


def generate(capsys, *args: str) -> dict:
    from titan_train.cli import main

    capsys.readouterr()
    assert main(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_trained_step_and_its_hf_export_generate_the_same_tokens(tmp_path, capsys):
    from titan_ckpt.commands.cli import main as titan_ckpt
    from titan_train.cli import main as titan_train

    dump = tmp_path / "run"
    assert titan_train([
        "train", "--job.dump_folder", str(dump), "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--training.steps", "4", "--optimizer.lr", "3e-3",
        "--metrics.no_enable_tensorboard", "--checkpoint.interval", "4",
        "--lr_scheduler.warmup_steps", "1",
    ]) == 0  # fmt: skip
    step, hf = dump / "checkpoint" / "step-4", tmp_path / "hf"
    assert titan_ckpt(["convert", str(step), str(hf), "--to", "hf"]) == 0

    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    greedy = [*prompts, "--temperature", "0", "--max_new_tokens", str(NEW), "--no-stop_at_eos"]
    from_step = generate(capsys, "--checkpoint.path", str(step), *greedy)
    from_hf = generate(capsys, "--checkpoint.path", str(hf), *greedy)
    assert from_hf["source"]["kind"] == "hf"
    tokens = [r["tokens"] for r in from_step["results"]]
    assert [r["tokens"] for r in from_hf["results"]] == tokens

    hf_model = transformers.LlamaForCausalLM.from_pretrained(hf).eval()
    for result in from_step["results"]:
        ids = torch.tensor([result["prompt_tokens"]])
        with torch.no_grad():
            out = hf_model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        assert out[0, ids.shape[1] :].tolist() == result["tokens"]
