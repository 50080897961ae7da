"""Test helpers: launching worker scripts under torchrun, and the workers' shared module."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from titan_dims import testing

WORKERS = Path(__file__).parent / "workers"


def run_torchrun(
    script: str, nproc: int, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``workers/<script>`` on ``nproc`` gloo ranks; returns the finished process, whatever
    its exit status (some tests kill a rank on purpose and read it)."""
    return testing.run_torchrun(
        WORKERS / script,
        nproc,
        args,
        timeout=timeout,
        env={"PYTHONWARNINGS": "ignore"},
        check=False,
    )


def read_results(out_dir: Path, name: str, nproc: int) -> list[dict]:
    return [json.loads((out_dir / f"{name}-rank{r}.json").read_text()) for r in range(nproc)]


def load_common() -> ModuleType:
    """The workers' ``common`` module, imported by path (tests run in importlib mode)."""
    spec = importlib.util.spec_from_file_location("titan_ckpt_test_common", WORKERS / "common.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def common() -> ModuleType:
    """The workers' shared module (tiny model, data, Stateful train state)."""
    return load_common()


@pytest.fixture(scope="session")
def torchrun():
    """``run_torchrun`` as a fixture: test modules cannot import conftest in importlib mode."""
    return run_torchrun


def _independent_digest(data: bytes, algorithm: str) -> str:
    """``data``'s checksum computed straight by hashlib or xxhash, not through titan-ckpt."""
    if algorithm == "sha256":
        return hashlib.sha256(data).hexdigest()
    import xxhash

    assert algorithm == "xxh3_128", algorithm
    return xxhash.xxh3_128(data).hexdigest()


@pytest.fixture(scope="session")
def default_checksum() -> str:
    """The algorithm ``checkpoint.checksum = "auto"`` picks here (xxhash installed or not)."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "sha256"
    return "xxh3_128"


@pytest.fixture(scope="session")
def entry_of(default_checksum):
    """``entry_of(data, algorithm=default)``: the manifest entry a file of ``data`` must
    have, {"size", algorithm: digest}, computed independently of titan-ckpt."""

    def entry(data: bytes, algorithm: str | None = None) -> dict:
        algorithm = algorithm or default_checksum
        return {"size": len(data), algorithm: _independent_digest(data, algorithm)}

    return entry


@pytest.fixture(scope="session")
def results():
    """``read_results`` as a fixture."""
    return read_results


@pytest.fixture(scope="session")
def saved_folder(tmp_path_factory, common) -> Path:
    """A checkpoint folder written by ``CheckpointManager`` in one process: step-1 and step-2
    (model, AdamW state, train state), plus an uncommitted step-3 as a crash would leave."""
    import torch

    from titan_ckpt import CheckpointConfig, CheckpointManager, OptimizerState

    folder = tmp_path_factory.mktemp("cli") / "ckpt"
    model = common.make_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_state = common.TrainState()
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(folder), interval=1, keep_latest_k=0,
                         last_save_model_only=False),
        model_parts=[model],
        states={"optimizer": OptimizerState(model, opt), "train_state": train_state},
    )  # fmt: skip
    for step in (1, 2):
        common.train_steps(model, opt, range(step, step + 1), rank=0)
        train_state.step = step
        manager.save(step)
    manager.close()
    (folder / "step-3").mkdir()
    return folder


@pytest.fixture
def titan_ckpt(capsys):
    """Run ``titan-ckpt ARGS...`` in this process; returns (exit status, stdout, stderr)."""
    from titan_ckpt.commands.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = main([str(a) for a in args])
        except SystemExit as exit_:  # argparse's own usage errors and --help
            code = int(exit_.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def install_adapters(tmp_path_factory, monkeypatch) -> Path:
    """Install workers/llama_adapters.py as a distribution on sys.path for this test: its
    dist-info declares the ``test-llama`` and ``test-llama-streaming`` entry points (group
    ``titan.state_dict_adapters``), so titan-ckpt finds them as it finds any adapter.
    Returns the site directory (put it on PYTHONPATH for child processes)."""
    site = tmp_path_factory.mktemp("site")
    shutil.copy(WORKERS / "llama_adapters.py", site / "titan_test_llama.py")
    info = site / "titan_test_llama-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: titan-test-llama\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[titan.state_dict_adapters]\n"
        "test-llama = titan_test_llama:make_adapter\n"
        "test-llama-streaming = titan_test_llama:make_streaming_adapter\n"
    )
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return site
