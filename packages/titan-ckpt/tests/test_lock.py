"""One writer per checkpoint folder (``titan_ckpt.lock``), checked with real locks: flock
held by this process and by another one (killed with SIGKILL to free it), on two gloo ranks;
the heartbeat lock on ``memory://``; and a real step committed into the folder by another
writer."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import time

import pytest

from titan_ckpt import (
    CheckpointConfig,
    CheckpointLockError,
    CheckpointManager,
    CheckpointWriteError,
    lock_checkpoint_folder,
)
from titan_ckpt.lock import LOCK_FILE, STALE_SECONDS


def hold(folder: str, ready) -> None:
    """Another process: take the folder's lock, say so, and keep it until killed."""
    lock = lock_checkpoint_folder(CheckpointConfig(enable=True, folder=folder))
    ready.set()
    time.sleep(300)
    lock.release()


def writer(common, folder, **config) -> CheckpointManager:
    config = CheckpointConfig(enable=True, folder=str(folder), interval=1, **config)
    return CheckpointManager(config, model_parts=common.make_model())


def listing(folder) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(folder)), p.stat().st_mtime_ns) for p in folder.rglob("*"))


def test_a_second_writer_is_refused_naming_the_holder_and_a_reader_is_not(common, tmp_path):
    first = writer(common, tmp_path)
    first.save(1)
    before = listing(tmp_path)
    with pytest.raises(CheckpointLockError) as refused:
        writer(common, tmp_path)
    message = str(refused.value)
    assert f"process {os.getpid()} on host {socket.gethostname()} (since 20" in message
    assert "checkpoint.load_only=true" in message
    assert f"titan-ckpt inspect {tmp_path}" in message
    assert listing(tmp_path) == before  # refused before any work
    reader = writer(common, tmp_path, load_only=True)  # a reader needs no lock
    assert reader.load()
    assert reader.last_loaded_step == 1
    reader.close()
    first.close()
    first.close()  # idempotent
    assert not (tmp_path / LOCK_FILE).exists()
    second = writer(common, tmp_path)  # the folder is free again
    second.save(2)
    second.close()


def test_a_killed_holder_frees_the_folder_for_the_next_run(common, tmp_path, caplog):
    fork = multiprocessing.get_context("fork")  # torch already imported: a fast start
    ready = fork.Event()
    holder = fork.Process(target=hold, args=(str(tmp_path), ready), daemon=True)
    holder.start()
    try:
        assert ready.wait(timeout=30)
        with pytest.raises(CheckpointLockError, match=f"process {holder.pid} on host"):
            writer(common, tmp_path)
        os.kill(holder.pid, signal.SIGKILL)  # no release: the kernel drops its flock
        holder.join(timeout=30)
        caplog.set_level(logging.WARNING, logger="titan_ckpt")
        with writer(common, tmp_path) as manager:
            manager.save(1)
    finally:
        holder.kill()
        holder.join()
    taken = [r.getMessage() for r in caplog.records if "Took over" in r.getMessage()]
    assert len(taken) == 1, caplog.text
    assert f"process {holder.pid} on host {socket.gethostname()}" in taken[0]


def test_a_lock_taken_first_is_handed_to_the_manager(common, tmp_path):
    config = CheckpointConfig(enable=True, folder=str(tmp_path))
    lock = lock_checkpoint_folder(config)
    assert lock.held
    with pytest.raises(CheckpointLockError):
        lock_checkpoint_folder(config)
    assert not lock_checkpoint_folder(CheckpointConfig(enable=True, folder=str(tmp_path),
                                                       load_only=True)).held  # fmt: skip
    # A manager given the lock keeps it and releases it on close.
    manager = CheckpointManager(config, model_parts=common.make_model(), folder_lock=lock)
    manager.save(1)
    manager.close()
    assert not lock.held
    assert not (tmp_path / LOCK_FILE).exists()
    # Folders made only for the lock go with it: a run refused later leaves nothing behind.
    fresh = lock_checkpoint_folder(CheckpointConfig(enable=True, folder=str(tmp_path / "a/b")))
    assert (tmp_path / "a" / "b" / LOCK_FILE).is_file()
    fresh.release()
    assert not (tmp_path / "a").exists()


def test_heartbeat_lock_on_fsspec_storage(common, caplog):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    url = f"memory://lock-test-{os.getpid()}/run"
    try:
        first = writer(common, url)
        with pytest.raises(CheckpointLockError, match=r"last heartbeat \d+ s ago"):
            writer(common, url)
        first.close()
        assert not fs.exists(f"{url}/{LOCK_FILE}")
        # A holder that died: its heartbeat stopped long ago.
        gone = time.time() - 2 * STALE_SECONDS
        dead = {"host": "node7", "pid": 4242, "since": gone, "heartbeat": gone, "token": "x"}
        fs.pipe(f"{url}/{LOCK_FILE}", json.dumps(dead).encode())
        caplog.set_level(logging.WARNING, logger="titan_ckpt")
        with writer(common, url) as manager:
            manager.save(1)
        (taken,) = [r.getMessage() for r in caplog.records if "Took over" in r.getMessage()]
        assert "process 4242 on host node7" in taken
        assert not fs.exists(f"{url}/{LOCK_FILE}")
    finally:
        fs.rm(url.rsplit("/", 1)[0], recursive=True)


def test_a_step_another_writer_committed_is_never_replaced(common, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    with writer(common, elsewhere) as other:
        other.save(3)  # committed before the run below starts: replaceable
    folder = tmp_path / "ckpt"
    shutil.copytree(elsewhere / "step-3", folder / "step-3")
    with writer(common, folder) as run:
        run.save(3)  # replaces it, as a resume from an older step does
        time.sleep(0.01)
        with writer(common, elsewhere) as other:
            other.save(4)
        # Another writer's step 4, committed after this run started, appears in its folder.
        shutil.copytree(elsewhere / "step-4", folder / "step-4")
        before = {p.name: p.read_bytes() for p in (folder / "step-4").iterdir()}
        with pytest.raises(CheckpointWriteError, match=r"Cannot save step 4: .*another run"):
            run.save(4)
        run.save(3)  # its own step it may replace
    assert {p.name: p.read_bytes() for p in (folder / "step-4").iterdir()} == before


@pytest.mark.slow
def test_every_rank_raises_the_refusal(torchrun, results, tmp_path):
    folder = tmp_path / "ckpt"
    lock = lock_checkpoint_folder(CheckpointConfig(enable=True, folder=str(folder)))
    proc = torchrun("lock_refused.py", 2, str(tmp_path), str(folder), timeout=90)
    lock.release()
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = results(tmp_path, "lock_refused", 2)
    assert first == second
    for message in first.values():
        assert message is not None
        assert f"process {os.getpid()} on host" in message
