"""Fuzz worker: random truncations and byte flips of a real small checkpoint, read by every
titan-ckpt reader, under a cap on address space.

    python fuzz_readers.py PRISTINE SCRATCH OUT.json --seed 0 --cases 300 --headroom-mib 256

PRISTINE holds ``step-1/`` (a DCP step written by CheckpointManager: .metadata, __0_0.distcp,
titan-commit.json), ``st/model.safetensors`` and ``model.pt``. Each case copies PRISTINE to
SCRATCH, damages one file, and runs the readers of its format: for DCP ``verify``, ``inspect
--stats`` and ``CheckpointManager.load``; for safetensors the command's reader, the manager's
Hugging Face import and ``verify``; for torch.save the command's reader and ``verify``.

Every reader must end normally or in one of titan-ckpt's errors. Before the cases start, one
clean pass warms every code path (thread pools, allocator arenas); then ``RLIMIT_AS`` caps the
process at its address space plus ``--headroom-mib``, far below any size a flipped header can
claim and far above what reading these few-KiB files needs, so an allocation sized from a
damaged header fails, and the case is recorded as "alloc" (a MemoryError, or an allocator
message inside an error). A case that runs past 20 s is a "hang" (SIGALRM). A crash kills this
process; the parent finds the case in PROGRESS (written before each case).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import sys
import traceback
from pathlib import Path

import torch

ALLOC_WORDS = ("MemoryError", "can't allocate", "bad_alloc", "Cannot allocate", "out of memory")
TARGETS = [
    ("metadata", "step-1/.metadata"),
    ("distcp", "step-1/__0_0.distcp"),
    ("marker", "step-1/titan-commit.json"),
    ("safetensors", "st/model.safetensors"),
    ("safetensors-header", "st/model.safetensors"),
    ("torch", "model.pt"),
]


class Hang(BaseException):
    pass


def _alarm(*_):
    raise Hang()


def ours() -> tuple[type[BaseException], ...]:
    from titan_ckpt.errors import CheckpointError

    return (CheckpointError,)


def mutate(data: bytes, rng: random.Random, header_only: bool) -> tuple[bytes, str]:
    limit = len(data)
    if header_only:  # a safetensors header: its 8-byte length and the JSON
        limit = min(len(data), 8 + int.from_bytes(data[:8], "little"))
    if rng.random() < 0.3:
        cut = rng.randrange(0, limit)
        return data[:cut], f"truncate at {cut}"
    out = bytearray(data)
    flips = []
    for _ in range(rng.choice((1, 1, 2, 4))):
        pos = rng.randrange(0, limit)
        out[pos] ^= rng.randrange(1, 256)
        flips.append(pos)
    return bytes(out), f"flip {flips}"


def verify_report(path: str) -> str | None:
    """``titan-ckpt verify``'s reading of ``path``: None if sound, else its problems."""
    from titan_ckpt.commands.verify import verify_path

    report = verify_path(path)
    return None if report["ok"] else "; ".join(report["problems"])


def _dcp_checks(root: Path) -> list:
    from titan_ckpt import CheckpointConfig, CheckpointManager, OptimizerState
    from titan_ckpt.commands.inspect import inspect_path

    common = _common()

    def manager_load() -> None:
        model = common.make_model(seed=1)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        manager = CheckpointManager(
            CheckpointConfig(enable=True, folder=str(root)),
            model_parts=[model],
            states={"optimizer": OptimizerState(model, opt), "train_state": common.TrainState()},
        )
        try:
            # A marker too damaged to parse makes the step uncommitted: the load starts fresh.
            return None if manager.load() else "loaded nothing: the step was not taken as committed"
        finally:
            manager.close()

    step = str(root / "step-1")
    return [
        ("verify", lambda: verify_report(step)),
        ("inspect", lambda: inspect_path(step, stats=True)),
        ("load", manager_load),
    ]


def _st_checks(root: Path) -> list:
    from titan_ckpt.formats.safetensors import SafetensorsSource
    from titan_ckpt.hf import hf_files
    from titan_ckpt.storage import LocalStorage

    path = str(root / "st" / "model.safetensors")

    def command_reader() -> None:
        source = SafetensorsSource(path)
        source.read(list(source.entries))

    def hf_import() -> None:
        for _ in hf_files(LocalStorage(), str(root / "st")).items():
            pass

    return [
        ("read", command_reader),
        ("hf-import", hf_import),
        ("verify", lambda: verify_report(path)),
    ]


def _torch_checks(root: Path) -> list:
    from titan_ckpt.formats.torch_save import TorchSource

    path = str(root / "model.pt")

    def read() -> None:
        source = TorchSource(path)
        source.read(list(source.entries))

    return [("read", read), ("verify", lambda: verify_report(path))]


def checks(kind: str, root: Path) -> list:
    if kind in ("metadata", "distcp", "marker"):
        return _dcp_checks(root)
    if kind.startswith("safetensors"):
        return _st_checks(root)
    return _torch_checks(root)


def _common():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "fuzz_common", Path(__file__).with_name("common.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_check(fn, allowed) -> tuple[str, str]:
    """The outcome of one reader: "ok", "reported" (it ended normally and returned a text
    naming the damage), "refused" (one of our errors), or what went wrong otherwise."""
    signal.alarm(20)
    try:
        report = fn()
        return ("reported", report[:300]) if isinstance(report, str) else ("ok", "")
    except allowed as error:
        text = f"{type(error).__name__}: {error}"
        return ("alloc" if any(w in text for w in ALLOC_WORDS) else "refused"), text[:300]
    except MemoryError as error:
        return "alloc", f"MemoryError: {error}"[:300]
    except Hang:
        return "hang", ""
    except BaseException as error:
        tail = "".join(traceback.format_exception(error)[-3:])
        return "foreign", f"{type(error).__name__}: {str(error)[:300]}\n{tail[-800:]}"
    finally:
        signal.alarm(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pristine", type=Path)
    parser.add_argument("scratch", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--headroom-mib", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, _alarm)
    allowed = ours()
    progress = args.out.with_suffix(".progress")

    def fresh() -> Path:
        shutil.rmtree(args.scratch, ignore_errors=True)
        shutil.copytree(args.pristine, args.scratch)
        return args.scratch

    root = fresh()  # the warm-up: every reader on the intact files must succeed
    for kind, _ in TARGETS:
        for name, fn in checks(kind, root):
            outcome, text = run_check(fn, allowed)
            if outcome != "ok":
                sys.exit(f"warm-up {kind}/{name} failed: {outcome} {text}")

    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    cap = vm + (args.headroom_mib << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    try:  # the cap must bite: an allocation past the headroom fails
        torch.empty((args.headroom_mib + 64) << 20, dtype=torch.uint8)
        sys.exit("the address-space cap did not stop an allocation beyond it")
    except RuntimeError:
        pass

    rng = random.Random(args.seed)
    results = []
    for case in range(args.cases):
        kind, rel = TARGETS[case % len(TARGETS)]
        root = fresh()
        target = root / rel
        data, how = mutate(target.read_bytes(), rng, header_only=kind == "safetensors-header")
        target.write_bytes(data)
        progress.write_text(json.dumps({"case": case, "kind": kind, "how": how}))
        for name, fn in checks(kind, root):
            outcome, text = run_check(fn, allowed)
            results.append(
                {"case": case, "kind": kind, "how": how, "check": name, "outcome": outcome,
                 "text": text}
            )  # fmt: skip
    args.out.write_text(json.dumps({"address_space_cap": cap, "results": results}))
    os._exit(0)  # skip interpreter teardown under the address-space cap


if __name__ == "__main__":
    main()
