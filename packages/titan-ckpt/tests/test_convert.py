"""``titan-ckpt convert`` and ``diff``: round trips DCP -> safetensors -> DCP and DCP -> torch
-> DCP are bit-exact (by our own diff's verdict, and by the loaded tensors), sharded
safetensors with an index, dtype casts and key filters, diff's tolerances and exit codes, and a
destination that is never clobbered nor left half-written."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_dcp_safetensors_dcp_is_bit_exact(saved_folder, tmp_path, titan_ckpt):
    src = saved_folder / "step-2"
    assert titan_ckpt("convert", src, tmp_path / "st", "--to", "safetensors")[0] == 0
    assert sorted(os.listdir(tmp_path / "st")) == ["model.safetensors"]
    assert titan_ckpt("convert", tmp_path / "st", tmp_path / "back", "--to", "dcp")[0] == 0
    code, out, _ = titan_ckpt("diff", src, tmp_path / "back", "--json")
    report = json.loads(out)
    assert code == 0
    assert report["equal"]
    assert report["compared"] == {"tensors": 24, "objects": 67}
    # The DCP written back carries a titan commit marker, so verify checks its checksums too.
    code, out, _ = titan_ckpt("verify", tmp_path / "back")
    assert code == 0
    assert "titan manifest" in out


def test_dcp_torch_dcp_is_bit_exact(saved_folder, tmp_path, titan_ckpt):
    src = saved_folder / "step-2"
    assert titan_ckpt("convert", src, tmp_path / "c.pt", "--to", "torch")[0] == 0
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    assert state["train_state.step"] == 2
    assert state["0.weight"].shape == (32, 16)
    assert titan_ckpt("convert", tmp_path / "c.pt", tmp_path / "back", "--to", "dcp")[0] == 0
    code, out, _ = titan_ckpt("diff", src, tmp_path / "back")
    assert code == 0, out
    assert out.splitlines()[-1].startswith("equal (atol=0, rtol=0; compared 24 tensors")


def test_sharded_safetensors_dtype_and_filters(saved_folder, tmp_path, titan_ckpt):
    src = saved_folder / "step-2"
    dst = tmp_path / "st"
    code, _, err = titan_ckpt("convert", src, dst, "--to", "safetensors", "--model-only",
                              "--max-shard-size", "3000B", "--exclude", "*.bias")  # fmt: skip
    assert code == 0, err
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == ["0.weight", "2.weight", "4.weight"]
    # 2048, 4096 and 512 bytes: a shard closes when the next tensor would pass 3000 B.
    assert sorted(set(index["weight_map"].values())) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    ]
    code, out, _ = titan_ckpt("diff", src, dst, "--include", "*.weight", "--exclude", "opt*")
    assert code == 0, out
    code, _, _ = titan_ckpt("convert", src, tmp_path / "half.safetensors", "--to",
                            "safetensors", "--dtype", "bf16", "--model-only")  # fmt: skip
    assert code == 0
    from safetensors.torch import load_file

    half = load_file(str(tmp_path / "half.safetensors"))
    assert half["0.weight"].dtype == torch.bfloat16
    # A bf16 cast differs from fp32 by at most 2^-8 relative: diff's tolerances decide.
    code, out, _ = titan_ckpt("diff", src, tmp_path / "half.safetensors", "--include", "[0-9]*")
    assert code == 1
    assert "shape or dtype differs (6)" in out


def test_diff_reports_values_keys_and_tolerance(saved_folder, tmp_path, titan_ckpt):
    a, b = saved_folder / "step-1", saved_folder / "step-2"
    code, out, _ = titan_ckpt("diff", a, b, "--json")
    report = json.loads(out)
    assert code == 1
    assert not report["equal"]
    changed = {r["key"]: r for r in report["different"]}
    assert changed["train_state.step"]["a"] == "1"
    assert changed["train_state.step"]["b"] == "2"
    assert changed["0.weight"]["max_abs"] > 0
    torch.save({"0.weight": torch.ones(2)}, tmp_path / "x.pt")
    torch.save({"0.weight": torch.ones(2) + 1e-6, "extra": torch.zeros(1)}, tmp_path / "y.pt")
    code, out, _ = titan_ckpt("diff", tmp_path / "x.pt", tmp_path / "y.pt")
    assert code == 1
    assert "only in b (1):\n  extra" in out
    code, out, _ = titan_ckpt("diff", tmp_path / "x.pt", tmp_path / "y.pt", "--exclude", "extra",
                              "--atol", "1e-5")  # fmt: skip
    assert code == 0, out
    code, out, _ = titan_ckpt("diff", tmp_path / "x.pt", tmp_path / "y.pt", "--exclude", "extra",
                              "--rtol", "1e-7")  # fmt: skip
    assert code == 1
    assert "0.weight: max abs 9.54e-07" in out
    # A filter that matches nothing is a mistake, not a clean diff of 0 tensors.
    x, y = tmp_path / "x.pt", tmp_path / "y.pt"
    code, out, err = titan_ckpt("diff", x, y, "--include", "model.*")
    assert code == 2
    assert "--include model.* matches no key of either checkpoint; keys look like '0.weight'" in err


def test_existing_destination_is_refused(saved_folder, tmp_path, titan_ckpt):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    code, _, err = titan_ckpt("convert", saved_folder / "step-2", dst, "--to", "safetensors")
    assert code == 2
    assert f"titan-ckpt: error: {dst} exists and is not empty; pass --overwrite" in err
    assert os.listdir(dst) == ["keep.txt"]
    code, _, err = titan_ckpt("convert", saved_folder / "step-2", dst, "--to", "safetensors",
                              "--overwrite")  # fmt: skip
    assert code == 0, err
    assert os.listdir(dst) == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["dst"]


def test_failed_conversion_leaves_nothing(saved_folder, tmp_path, titan_ckpt):
    import shutil

    broken = tmp_path / "src" / "step-2"
    shutil.copytree(saved_folder / "step-2", broken)
    data = broken / "__0_0.distcp"
    os.truncate(data, data.stat().st_size // 2)
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    code, _, err = titan_ckpt("convert", broken, out_parent / "st", "--to", "safetensors")
    assert code == 1
    # Found before any allocation: the entry's bytes lie beyond the truncated file's end.
    assert "of __0_0.distcp, which has" in err
    assert "titan-ckpt verify" in err
    assert os.listdir(out_parent) == []


def _truncated(path, name=None):
    """``path`` (or its member ``name``) cut to half its size."""
    target = path / name if name else path
    os.truncate(target, target.stat().st_size // 2)
    return path


@pytest.mark.parametrize(
    "damage",
    [
        "dcp data",  # found while the tensors stream into the DCP writer
        "dcp metadata",
        "torch.save",  # was "not a torch.save file", a usage error (2)
        "safetensors",
    ],
)
def test_damaged_source_to_dcp_is_one_line_and_leaves_nothing(
    saved_folder, tmp_path, titan_ckpt, damage
):
    import shutil

    step = tmp_path / "src" / "step-2"
    shutil.copytree(saved_folder / "step-2", step)
    if damage.startswith("dcp"):
        src = _truncated(step, "__0_0.distcp" if damage == "dcp data" else ".metadata")
    else:
        to, name = ("torch", "c.pt") if damage == "torch.save" else ("safetensors", "c.safetensors")
        assert titan_ckpt("convert", step, tmp_path / name, "--to", to)[0] == 0
        src = _truncated(tmp_path / name)
    out_parent = tmp_path / "out"  # not ours: kept, as is what it holds
    out_parent.mkdir()
    (out_parent / "keep.txt").write_text("mine")
    # --model-only: tensors alone, so that no object is read before DCP's writer streams them.
    dst = out_parent / "made" / "dst"
    code, _, err = titan_ckpt("convert", src, dst, "--to", "dcp", "--model-only")
    assert code == 1
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("titan-ckpt: error: ")
    assert "titan-ckpt verify" in err
    assert os.listdir(out_parent) == ["keep.txt"]  # made/, which convert created, is gone


def test_console_script_module_and_help(tmp_path):
    # One real process: the entry point as installed (python -m: same function).
    proc = subprocess.run([sys.executable, "-m", "titan_ckpt.commands.cli", "convert", "--help"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0
    assert "--max-shard-size" in proc.stdout
    assert "--overwrite" in proc.stdout


def test_streamed_outputs_load_with_plain_torch(tmp_path, titan_ckpt):
    """DCP and torch.save outputs are written tensor by tensor (titan_ckpt.formats); they
    must be what dcp.save and torch.save write: loadable by dcp.load, dcp_to_torch_save and
    torch.load (memory-mapped too); the torch.save files with valid zip CRCs, the DCP records
    without (as the manager writes them). The input has the awkward cases: a
    transposed view, a slice of a larger storage, bf16, an empty tensor, a list holding a
    tensor, nested dicts."""
    import zipfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    g = torch.Generator().manual_seed(0)
    src = {
        "w": torch.randn(300, 7, generator=g),
        "t": torch.randn(10, 10, generator=g).t(),
        "piece": torch.arange(100.0)[10:20],
        "nested": {"half": torch.ones(2, dtype=torch.bfloat16), "empty": torch.empty(0, 3)},
        "listed": [torch.arange(5), 3],
        "step": 9,
    }
    torch.save(src, tmp_path / "src.pt")
    for args in (("src.pt", "a.pt", "torch"), ("src.pt", "dcp", "dcp"), ("dcp", "b.pt", "torch")):
        code, _, err = titan_ckpt("convert", *(tmp_path / a for a in args[:2]), "--to", args[2])
        assert code == 0, err
    # The DCP output's records skip torch.save's CRC-32s, as the manager's saves do; a
    # torch.save file (a zip users may open) has every one right.
    out = tmp_path / "dcp"
    crcs = set()
    for info in dcp.FileSystemReader(str(out)).read_metadata().storage_data.values():
        with open(out / info.relative_path, "rb") as f:
            f.seek(info.offset)
            crcs |= {m.CRC for m in zipfile.ZipFile(io.BytesIO(f.read(info.length))).infolist()}
    assert crcs == {0}
    for name in ("a.pt", "b.pt"):
        assert zipfile.ZipFile(tmp_path / name).testzip() is None  # every CRC-32 is right
        loaded = torch.load(tmp_path / name, weights_only=True)
        mapped = torch.load(tmp_path / name, weights_only=True, mmap=True)
        for key in ("w", "t", "piece", "nested.half", "nested.empty"):
            expected = src[key] if "." not in key else src["nested"][key.split(".")[1]]
            assert torch.equal(loaded[key], expected), (name, key)
            assert torch.equal(mapped[key], expected), (name, key)
        assert loaded["step"] == 9
    assert torch.equal(
        torch.load(tmp_path / "a.pt", weights_only=True)["listed"][0], torch.arange(5)
    )
    assert titan_ckpt("diff", tmp_path / "src.pt", tmp_path / "a.pt")[0] == 0
    assert titan_ckpt("diff", tmp_path / "dcp", tmp_path / "b.pt")[0] == 0

    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "ref.pt")
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert torch.equal(ref["t"], src["t"])
    assert torch.equal(ref["listed"][0], torch.arange(5))  # DCP flattened the list
    target = {"w": torch.empty(300, 7), "nested": {"half": torch.zeros(2, dtype=torch.bfloat16)}}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert torch.equal(target["w"], src["w"])
    assert torch.equal(target["nested"]["half"], src["nested"]["half"])
