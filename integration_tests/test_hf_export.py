"""HF exports that describe what was trained: vocabulary and RoPE from the checkpoint, not a
flavor's defaults.

Checked against transformers' own ``LlamaForCausalLM.from_pretrained`` (built from the
written folder, no download), logits compared with titan's model in fp32:

- ``titan-ckpt convert --to hf --flavor debugmodel`` on a checkpoint with a 2,000-token
  vocabulary (no recorded args): config.json says 2,000, the model loads, logits agree; the
  RoPE it assumes is printed in one line; ``--rope-scaling none`` writes plain RoPE, which
  an HF -> DCP -> HF round trip keeps (the DCP step records the model read from config.json);
- a contradicting ``--flavor`` or ``--hf-config``: exit 2 naming each field, DST not created;
- a checkpoint with the model record (``CheckpointManager(metadata=...)``) converts without
  ``--model``/``--flavor`` and keeps its RoPE;
- ``titan-train`` with a tokenizer of another size and ``--model.rope_scaling none``:
  ``last_save_in_hf`` loads in transformers with equal logits, which equal a plain-RoPE model
  and differ from a scaled one; the commit manifest records the args.

Positions up to 1,024 make the RoPE variants differ by many times the fp32 tolerance (Llama
3.1 scaling only slows the low frequencies, which matter at long range).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
titan_models = pytest.importorskip("titan_models")

from titan_ckpt.layout import read_manifest  # noqa: E402
from titan_ckpt.storage import LocalStorage  # noqa: E402
from titan_models.llama3 import RopeScaling, rope_scaling_of  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

VOCAB = 2000
SEQ = 1024


def titan_ckpt(*args: object) -> subprocess.CompletedProcess:
    """The command as a user runs it, in its own process."""
    cmd = [sys.executable, "-m", "titan_ckpt.commands.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.fixture
def titan_ckpt_here(capsys):
    """``titan-ckpt ARGS`` in this process (saves a torch import per call): returns a
    ``CompletedProcess``-like result with returncode and stderr."""
    from titan_ckpt.commands.cli import main

    def run(*args: object) -> subprocess.CompletedProcess:
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


def save_step(folder, args, metadata=None):
    """A titan Llama 3 of ``args``, saved by CheckpointManager as step 3 (model only)."""
    from titan_ckpt import CheckpointConfig, CheckpointManager

    torch.manual_seed(0)
    model = titan_models.llama3.Llama3(args)
    model.init_weights()
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(folder), interval=1),
        model_parts=[model],
        metadata=metadata,
    )
    manager.save(3)
    manager.close()
    return model.eval(), folder / "step-3"


def logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def reference(model, rope: str) -> torch.nn.Module:
    """``model``'s weights in a titan Llama 3 with ``rope`` and a table of SEQ positions."""
    args = dataclasses.replace(model.args, max_seq_len=SEQ)
    args = dataclasses.replace(args, rope_scaling=rope_scaling_of(rope, RopeScaling()))
    other = titan_models.llama3.Llama3(args)
    other.load_state_dict(model.state_dict())
    return other.eval()


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def unrecorded(tmp_path_factory):
    """debugmodel with a 2,000-token vocabulary, saved without the model record (as titan
    before it, or any caller of CheckpointManager that passes no metadata)."""
    args = titan_models.llama3.llama3_args("debugmodel", vocab_size=VOCAB, max_seq_len=64)
    return save_step(tmp_path_factory.mktemp("unrecorded"), args)


def test_flavor_export_takes_the_vocabulary_from_the_tensors(unrecorded, tmp_path):
    model, step = unrecorded
    hf = tmp_path / "hf"
    proc = titan_ckpt("convert", step, hf, "--to", "hf", "--model", "llama3", "--flavor",
                      "debugmodel")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    config = json.loads((hf / "config.json").read_text())
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (
        VOCAB, 256, 6)  # fmt: skip
    # No record, no --rope-scaling: the flavor's RoPE, said in one line.
    notes = [line for line in proc.stderr.splitlines() if "records no model args" in line]
    assert len(notes) == 1
    assert "assuming the RoPE of --flavor debugmodel" in notes[0]
    assert '"rope_type": "llama3"' in notes[0]
    assert "--rope-scaling none" in notes[0]
    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(hf)).eval()
    x = tokens(VOCAB)
    torch.testing.assert_close(logits(hf_model, x), logits(reference(model, "llama3"), x),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_rope_scaling_none_writes_plain_rope(unrecorded, tmp_path, titan_ckpt_here):
    model, step = unrecorded
    hf = tmp_path / "hf"
    proc = titan_ckpt_here("convert", step, hf, "--to", "hf", "--model", "llama3", "--flavor",
                      "debugmodel", "--rope-scaling", "none")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "records no model args" not in proc.stderr
    assert json.loads((hf / "config.json").read_text())["rope_scaling"] is None
    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(hf)).eval()
    x = tokens(VOCAB)
    theirs = logits(hf_model, x)
    torch.testing.assert_close(theirs, logits(reference(model, "none"), x), rtol=1e-5, atol=1e-5)
    # The RoPE variant matters at these positions: the scaled model is off by many times the
    # tolerance (about 7e-4 on this random init).
    assert (theirs - logits(reference(model, "llama3"), x)).abs().max() > 2e-4
    # HF -> DCP records the model read from config.json; back to HF, the record decides.
    back = tmp_path / "back"
    proc = titan_ckpt_here("convert", hf, back, "--to", "dcp", "--model", "llama3")
    assert proc.returncode == 0, proc.stderr
    record = read_manifest(LocalStorage(), str(back)).metadata["model"]
    assert (record["name"], record["args"]["rope_scaling"]) == ("llama3", None)
    assert record["args"]["vocab_size"] == VOCAB
    again = tmp_path / "again"
    proc = titan_ckpt_here("convert", back, again, "--to", "hf")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((again / "config.json").read_text())["rope_scaling"] is None


def test_contradicting_flavor_or_hf_config_exits_2_naming_each_field(
    unrecorded, tmp_path, titan_ckpt_here
):
    model, step = unrecorded
    wrong = tmp_path / "wrong.json"
    good = titan_models.llama3.Llama3StateDictAdapter(model.args).hf_config()
    wrong.write_text(json.dumps({**good, "vocab_size": 2048, "intermediate_size": 1024}))
    cases = {
        "--flavor": (
            ("--flavor", "8B"),
            ["dim (hidden_size): expected 4096 from flavor '8B', found 256",
             "n_layers (num_hidden_layers): expected 32 from flavor '8B', found 6",
             "ffn hidden size (intermediate_size): expected 14336 from flavor '8B', found 768"],
        ),
        "--hf-config": (
            ("--hf-config", wrong),
            ["vocab_size: expected 2048 from the HF config, found 2000",
             "ffn hidden size (intermediate_size): expected 1024 from the HF config, found 768"],
        ),
    }  # fmt: skip
    before = _disk(step.parent, tmp_path)
    for flags, fields in cases.values():
        dst = tmp_path / "out"
        proc = titan_ckpt_here("convert", step, dst, "--to", "hf", "--model", "llama3", *flags)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("titan-ckpt: error: "), proc.stderr
        for field in fields:
            assert field in proc.stderr, (field, proc.stderr)
        assert not dst.exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    # Nothing on disk changed: the checkpoint read, the config given, no output left.
    assert _disk(step.parent, tmp_path) == before


def _disk(*roots):
    """Every path under ``roots``: a file's bytes, None for a directory."""
    paths = [p for root in roots for p in sorted(root.rglob("*"))]
    return {p: p.read_bytes() if p.is_file() else None for p in paths}


def test_recorded_args_describe_the_export(tmp_path, titan_ckpt_here):
    args = titan_models.llama3.llama3_args("debugmodel", vocab_size=VOCAB, max_seq_len=64,
                                    rope_scaling="none")  # fmt: skip
    record = {"name": "llama3", "flavor": "debugmodel", "args": dataclasses.asdict(args)}
    model, step = save_step(tmp_path / "ckpt", args, metadata={"model": record})
    from titan_ckpt.layout import read_manifest
    from titan_ckpt.storage import LocalStorage

    assert (
        read_manifest(LocalStorage(), str(step)).metadata["model"]["args"]["rope_scaling"] is None
    )
    hf = tmp_path / "hf"
    proc = titan_ckpt_here("convert", step, hf, "--to", "hf")  # the record names model and args
    assert proc.returncode == 0, proc.stderr
    assert "records no model args" not in proc.stderr
    config = json.loads((hf / "config.json").read_text())
    assert (config["vocab_size"], config["rope_scaling"]) == (VOCAB, None)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(hf)).eval()
    x = tokens(VOCAB)
    torch.testing.assert_close(logits(hf_model, x), logits(reference(model, "none"), x),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    # A --rope-scaling that contradicts the record is refused; the record is what was trained.
    proc = titan_ckpt_here(
        "convert", step, tmp_path / "o", "--to", "hf", "--rope-scaling", "llama3"
    )
    assert proc.returncode == 2
    assert "contradicts the model args recorded" in proc.stderr
    assert not (tmp_path / "o").exists()
    # DCP -> DCP keeps the record.
    proc = titan_ckpt_here("convert", step, tmp_path / "copy", "--to", "dcp")
    assert proc.returncode == 0, proc.stderr
    assert read_manifest(LocalStorage(), str(tmp_path / "copy")).metadata == {"model": record}


def test_titan_train_last_save_in_hf_with_another_vocabulary_and_plain_rope(tmp_path):
    from titan_train.tokenizer import load_tokenizer
    from titan_train.tokenizer.load import default_tokenizer_path

    # The shipped BPE ranks under another name load with Llama 3's 256 special tokens.
    bpe = tmp_path / "bpe.model"
    shutil.copy(default_tokenizer_path(), bpe)
    vocab = load_tokenizer(bpe).vocab_size
    assert vocab != titan_models.llama3.LLAMA3_FLAVORS["debugmodel"].vocab_size
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "titan_train.cli",
           "--job.dump_folder", str(out),
           "--model.tokenizer_path", str(bpe),
           "--model.rope_scaling", "none",
           "--training.steps", "2",
           "--training.seq_len", "32",
           "--training.local_batch_size", "2",
           "--parallelize.param_dtype", "float32",
           "--checkpoint.last_save_model_only",
           "--checkpoint.last_save_in_hf"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    step = out / "checkpoint" / "step-2"

    record = read_manifest(LocalStorage(), str(step)).metadata["model"]
    assert (record["name"], record["flavor"]) == ("llama3", "debugmodel")
    assert (record["args"]["vocab_size"], record["args"]["rope_scaling"]) == (vocab, None)
    config = json.loads((step / "hf" / "config.json").read_text())
    assert (config["vocab_size"], config["rope_scaling"]) == (vocab, None)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(step / "hf")).eval()
    # titan's model as trained, its weights read back from the DCP step.
    import torch.distributed.checkpoint as dcp

    trained = titan_models.llama3.Llama3(titan_models.llama3.Llama3Args(**record["args"]))
    state = trained.state_dict()
    dcp.load(state, checkpoint_id=str(step), no_dist=True)
    trained.load_state_dict(state)
    x = tokens(vocab)
    theirs = logits(hf_model, x)
    torch.testing.assert_close(theirs, logits(reference(trained, "none"), x), rtol=1e-5, atol=1e-5)
    assert (theirs - logits(reference(trained, "llama3"), x)).abs().max() > 2e-4
