"""Qwen3 through the real ``titan-train`` command (gloo, CPU): continue pretraining from
Hugging Face weights.

A tiny Qwen3 is built with ``transformers`` from a config (random weights, no download) and
saved with ``save_pretrained``; its shape is a titan flavor's (``debugmodel``: dense, tied
embeddings, its embedding padded to 2,176 rows beyond the shipped 2,048-token BPE, as
published Qwen3 weights pad theirs; ``debugmodel_moe``: 8 experts, top 2, 2,048 rows). Then,
as a user runs it:

``titan-train --model.name qwen3 --model.flavor <flavor> --checkpoint.initial_load_path <hf>
--checkpoint.initial_load_in_hf --checkpoint.last_save_in_hf ...``

- the loss of step 1 equals transformers' loss on the batch the trainer read (the same
  dataloader and tokenizer, run here), fp32 within 1e-5: dense in one process, on 2 FSDP
  ranks, on 2 tensor-parallel ranks and on 2 pipeline stages (the tied embedding split
  between them, still one matrix after training), and the MoE shape in one process and on 2 ranks
  with expert parallel (FSDP x EP);
- the ``last_save_in_hf`` folder loads in transformers with logits equal to titan's model
  read from the DCP step beside it (the trained weights);
- an HF folder of another architecture (``LlamaForCausalLM``) or another shape exits 2 before
  any work, with one message naming the mismatch, and creates nothing.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional

transformers = pytest.importorskip("transformers")
titan_models = pytest.importorskip("titan_models")
pytest.importorskip("safetensors")

SEQ, BATCH = 64, 2
VOCAB = 2048  # the shipped BPE's vocabulary (titan_train.tokenizer's default)
PADDED = 2176  # an embedding padded beyond the tokenizer, as published Qwen3 weights are

# HF config fields of the titan flavors (titan_models.qwen3.QWEN3_FLAVORS).
DENSE = {
    "vocab_size": PADDED, "hidden_size": 256, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 3072, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
    "max_position_embeddings": 4096, "tie_word_embeddings": True,
}  # fmt: skip
MOE = {
    **DENSE, "vocab_size": VOCAB, "tie_word_embeddings": False,
    "moe_intermediate_size": 768, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
}  # fmt: skip


def save_hf(folder: Path, cls_name: str, config_cls: str, **fields) -> Path:
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**fields)
    getattr(transformers, cls_name)(config).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def hf_dense(tmp_path_factory) -> Path:
    return save_hf(tmp_path_factory.mktemp("hf") / "dense", "Qwen3ForCausalLM", "Qwen3Config",
                   **DENSE)  # fmt: skip


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory) -> Path:
    return save_hf(tmp_path_factory.mktemp("hf") / "moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                   **MOE)  # fmt: skip


def titan_train(folder: Path, hf: Path, flavor: str, *args: str, nproc: int = 1):
    cmd = [
        sys.executable, "-m", "titan_train.cli", "--nproc-per-node", str(nproc),
        "--job.dump_folder", str(folder),
        "--model.name", "qwen3", "--model.flavor", flavor,
        "--checkpoint.enable",
        "--checkpoint.initial_load_path", str(hf),
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.last_save_model_only",
        "--checkpoint.last_save_in_hf",
        "--training.steps", "2",
        "--training.seq_len", str(SEQ),
        "--training.local_batch_size", str(BATCH),
        "--metrics.log_freq", "1",
        "--parallelize.param_dtype", "float32",
        *args,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def first_batch(dp_degree: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step 1: every data-parallel rank's first batch, as the trainer's
    dataloader cuts it from the default (embedded) corpus with the default tokenizer."""
    from titan_train.config import TrainingConfig
    from titan_train.data import DataConfig, build_dataloader
    from titan_train.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    assert tokenizer.vocab_size == VOCAB
    # The trainer's data: its default virtual shards (training.data_shards).
    shards = TrainingConfig().data_shards
    config = DataConfig(seq_len=SEQ, local_batch_size=BATCH, num_shards=shards)
    parts = [
        next(iter(build_dataloader(config, tokenizer, dp_rank=rank, dp_degree=dp_degree)))
        for rank in range(dp_degree)
    ]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def hf_loss(hf: Path, cls_name: str, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    model = getattr(transformers, cls_name).from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(inputs).logits
    return functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()


def logged(folder: Path, step: int) -> dict:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return next(r for r in map(json.loads, lines) if r.get("step") == step and "loss" in r)


def check_export(folder: Path, cls_name: str, vocab: int) -> None:
    """The last save's HF folder in transformers: logits equal to titan's model holding the
    DCP step's weights."""
    import torch.distributed.checkpoint as dcp

    from titan_ckpt.layout import read_manifest
    from titan_ckpt.storage import LocalStorage

    step = folder / "checkpoint" / "step-2"
    record = read_manifest(LocalStorage(), str(step)).metadata["model"]
    assert (record["name"], record["args"]["vocab_size"]) == ("qwen3", vocab)
    ours = titan_models.qwen3.Qwen3(titan_models.qwen3.Qwen3Args(**record["args"]))
    state = ours.state_dict()
    dcp.load(state, checkpoint_id=str(step), no_dist=True)
    ours.load_state_dict(state)
    # Trained without DeepSeek-V3's balancing bias (--model.load_balance_coeff 0; HF's
    # Qwen3-MoE has no place for it), the model is exported exactly, routing included.
    assert not any(name.endswith("moe.expert_bias") for name, _ in ours.named_buffers())
    theirs = getattr(transformers, cls_name).from_pretrained(str(step / "hf")).eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours.eval()(tokens), rtol=1e-5,
                                   atol=1e-5)  # fmt: skip


# name -> (flavor, HF class, ranks, data-parallel degree, extra flags)
RUNS = {
    "dense": ("debugmodel", "Qwen3ForCausalLM", 1, 1, ()),
    "dense_fsdp": ("debugmodel", "Qwen3ForCausalLM", 2, 2, ()),
    "dense_tp": (
        "debugmodel", "Qwen3ForCausalLM", 2, 1,
        ("--parallelism.data_parallel_shard_degree", "1",
         "--parallelism.tensor_parallel_degree", "2"),
    ),
    "dense_pp": (
        "debugmodel", "Qwen3ForCausalLM", 2, 1,
        ("--parallelism.data_parallel_shard_degree", "1",
         "--parallelism.pipeline_parallel_degree", "2"),
    ),
    # Without the balancing bias, which HF's Qwen3-MoE cannot hold: an exact export.
    "moe": ("debugmodel_moe", "Qwen3MoeForCausalLM", 1, 1, ("--model.load_balance_coeff", "0")),
    "moe_ep": (
        "debugmodel_moe", "Qwen3MoeForCausalLM", 2, 2,
        ("--parallelism.expert_parallel_degree", "2", "--model.load_balance_coeff", "0"),
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "run",
    # CI keeps the command loading HF weights (dense); the MoE import is CI's in titan-models'
    # tests/qwen3/test_adapter.py, each layout's in its test_parallelize.py: here `full`.
    [run if run == "dense" else pytest.param(run, marks=pytest.mark.full) for run in RUNS],
)
def test_continue_pretraining_from_hf_weights(run, hf_dense, hf_moe, tmp_path):
    flavor, cls_name, nproc, dp_degree, flags = RUNS[run]
    hf = hf_moe if flavor.endswith("moe") else hf_dense
    folder = tmp_path / "run"
    proc = titan_train(folder, hf, flavor, *flags, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Loaded Hugging Face weights" in proc.stderr
    inputs, labels = first_batch(dp_degree)
    expected = hf_loss(hf, cls_name, inputs, labels)
    assert abs(logged(folder, 1)["loss"] - expected) <= 1e-5 * max(1.0, abs(expected))
    assert logged(folder, 2)["loss"] != logged(folder, 1)["loss"]  # it trained
    check_export(folder, cls_name, PADDED if hf is hf_dense else VOCAB)
    if run == "dense_pp":
        # The tied matrix lives on both pipeline stages; after two updates they are still one.
        import torch.distributed.checkpoint as dcp

        ends = {k: torch.empty(PADDED, 256) for k in ("tok_embeddings.weight", "output.weight")}
        dcp.load(ends, checkpoint_id=str(folder / "checkpoint" / "step-2"), no_dist=True)
        torch.testing.assert_close(ends["output.weight"], ends["tok_embeddings.weight"], rtol=0,
                                   atol=0)  # fmt: skip


def test_an_hf_folder_of_another_architecture_or_shape_exits_2_before_any_work(tmp_path):
    llama = save_hf(
        tmp_path / "llama", "LlamaForCausalLM", "LlamaConfig", vocab_size=VOCAB, hidden_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    )  # fmt: skip
    narrow = save_hf(tmp_path / "narrow", "Qwen3ForCausalLM", "Qwen3Config",
                     **{**DENSE, "hidden_size": 128, "num_hidden_layers": 2})  # fmt: skip
    cases = {
        llama: ["LlamaForCausalLM", "Qwen3ForCausalLM or Qwen3MoeForCausalLM"],
        narrow: ["dim: 256 vs 128", "n_layers: 8 vs 2"],
    }
    for hf, words in cases.items():
        folder = tmp_path / f"out_{hf.name}"
        proc = titan_train(folder, hf, "debugmodel", nproc=2)
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if "titan-train: error:" in line]
        assert len(errors) == 1, proc.stderr[-3000:]
        assert f"checkpoint.initial_load_path={str(hf)!r}" in errors[0]
        for word in words:
            assert word in errors[0], (word, errors[0])
        assert not folder.exists()


def test_the_flavors_match_the_test_configs():
    """The HF configs above are the flavors' shapes (else the runs above test nothing)."""
    from titan_models.qwen3 import QWEN3_FLAVORS, args_from_hf_config

    for flavor, fields, cls in (("debugmodel", DENSE, "Qwen3ForCausalLM"),
                                ("debugmodel_moe", MOE, "Qwen3MoeForCausalLM")):  # fmt: skip
        config = getattr(transformers, cls.replace("ForCausalLM", "Config"))(**fields).to_dict()
        read = args_from_hf_config({**config, "architectures": [cls]})
        want = dataclasses.replace(QWEN3_FLAVORS[flavor], vocab_size=fields["vocab_size"])
        assert dataclasses.replace(read, max_seq_len=want.max_seq_len) == want


def test_a_tied_model_resumes_across_the_pipeline_split(hf_dense, tmp_path):
    """A tied flavor's checkpoint does not depend on pipeline parallel: one process saves
    steps 1 and 2; pp 2 resumes its step 1 and saves a step 2 equal to the single process's,
    weights and optimizer state, the last stage's copy of the tied matrix included (its
    update needs the tied weight's optimizer state, loaded on both stages). The pp checkpoint
    holds that state under the one name a single process uses."""
    import torch.distributed.checkpoint as dcp

    full = ("--checkpoint.interval", "1", "--checkpoint.no_last_save_in_hf",
            "--checkpoint.no_last_save_model_only")  # fmt: skip
    single = tmp_path / "single"
    proc = titan_train(single, hf_dense, "debugmodel", *full)
    assert proc.returncode == 0, proc.stderr[-4000:]
    split = tmp_path / "split"
    shutil.copytree(single / "checkpoint" / "step-1", split / "checkpoint" / "step-1")
    pp = ("--parallelism.data_parallel_shard_degree", "1",
          "--parallelism.pipeline_parallel_degree", "2")  # fmt: skip
    proc = titan_train(split, hf_dense, "debugmodel", *full, *pp, nproc=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Loaded Hugging Face weights" not in proc.stderr  # it resumed from step 1
    expected = logged(single, 2)["loss"]
    assert abs(logged(split, 2)["loss"] - expected) <= 1e-5 * abs(expected)

    def step_2(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
        state = {name: torch.empty(PADDED, 256) for name in names}
        dcp.load(state, checkpoint_id=str(folder / "checkpoint" / "step-2"), no_dist=True)
        return state

    exp_avg = "optimizer.state.tok_embeddings.weight.exp_avg"
    names = ["tok_embeddings.weight", "output.weight", exp_avg]
    ours, theirs = step_2(split, names), step_2(single, names)
    for name in names:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours["output.weight"], theirs["tok_embeddings.weight"])
    meta = dcp.FileSystemReader(str(split / "checkpoint" / "step-2")).read_metadata()
    assert not any(k.startswith("optimizer.state.output.weight") for k in meta.state_dict_metadata)
