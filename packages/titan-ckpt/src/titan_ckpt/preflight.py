"""The checkpoint folder, checked before a run does any work.

titan-ckpt never deletes, overwrites or writes into a step directory it did not create (see
``titan_ckpt.layout``). ``check_folder`` turns that rule into one early, actionable error:

- a ``foreign`` step directory (plain DCP, unknown files, a titan step that lost its markers)
  stops the run: titan can neither resume from it nor save beside it safely;
- a torchtitan checkpoint is fine to resume from, but a step this run would save (from the
  step it resumes at to ``final_step``, by the save policy) must not be one of them.

``CheckpointManager`` applies the first rule when it loads, and refuses at save time to write
into a directory that is not its own; a trainer calls ``check_folder`` first, so the run stops
before it builds anything.
"""

from __future__ import annotations

from titan_ckpt.config import CheckpointConfig, CheckpointConfigError
from titan_ckpt.layout import StepScan, scan_steps, step_dir
from titan_ckpt.storage import Storage, storage_for
from titan_ckpt.torchtitan import TORCHTITAN_STATES, read_state_keys

__all__ = ["check_folder", "foreign_steps_error", "saves_step"]


def saves_step(config: CheckpointConfig, step: int, *, last_step: bool = False) -> bool:
    """Whether the save policy of ``config`` writes a checkpoint after step ``step``."""
    if not config.enable or config.load_only:
        return False
    if config.create_seed_checkpoint:
        return step == 0
    if last_step or step % config.interval == 0:
        return True
    return step == 1 and config.enable_first_step_checkpoint


def _describe(storage: Storage, directory: str) -> str:
    if not storage.is_dir(directory):
        return "not a directory"
    keys = read_state_keys(storage, directory)
    if keys is None:
        return "no titan marker and no readable DCP metadata"
    if not any(k.split(".", 1)[0] in TORCHTITAN_STATES for k in keys):
        return (
            "a model-only DCP checkpoint, e.g. torchtitan's seed or its last save with "
            "last_save_model_weights_only"
        )
    return "a DCP checkpoint without the training state of titan or torchtitan"


def foreign_steps_error(storage: Storage, folder: str, steps: list[int]) -> CheckpointConfigError:
    """The error for step directories under ``folder`` that titan did not write."""
    found = "; ".join(
        f"{step_dir(storage, folder, s)} ({_describe(storage, step_dir(storage, folder, s))})"
        for s in steps
    )
    return CheckpointConfigError(
        f"checkpoint.folder={folder!r} holds step directories titan did not write and cannot "
        f"resume from: {found}. titan never deletes, overwrites or writes into such a "
        "directory, so the run stops here. Use another checkpoint.folder, or move these "
        "directories away; to start from one of them, set checkpoint.initial_load_path to it "
        "with a checkpoint.folder that does not contain it."
    )


def _collisions(config: CheckpointConfig, scan: StepScan, final_step: int) -> list[int]:
    """torchtitan steps this run would save over."""
    loadable = scan.committed + scan.torchtitan
    start = config.load_step if config.load_step != -1 else max(loadable, default=0)
    return [
        s
        for s in scan.torchtitan
        if (start < s <= final_step and saves_step(config, s, last_step=s == final_step))
        or (config.create_seed_checkpoint and s == 0)
    ]


def check_folder(
    config: CheckpointConfig, *, final_step: int | None = None, storage: Storage | None = None
) -> StepScan | None:
    """Raise ``CheckpointConfigError`` if the run would have to touch a directory that is not
    its own (see the module docstring); returns the scan, or None when checkpointing is off.

    Args:
        config: the run's checkpoint policy; ``config.folder`` is the folder checked.
        final_step: the run's last training step; with it, saves that would land on a
            torchtitan step are refused too.
        storage: where the folder lives; default from ``config.folder``.
    """
    if not config.enable:
        return None
    storage = storage if storage is not None else storage_for(config.folder)
    scan = scan_steps(storage, config.folder, log=False)  # loading logs them
    if scan.foreign:
        raise foreign_steps_error(storage, config.folder, scan.foreign)
    if final_step is not None:
        clash = _collisions(config, scan, final_step)
        if clash:
            where = ", ".join(str(step_dir(storage, config.folder, s)) for s in clash)
            raise CheckpointConfigError(
                f"This run would save step(s) {clash} over torchtitan checkpoint(s) {where} "
                "(it trains to step "
                f"{final_step} and saves every checkpoint.interval={config.interval} steps); "
                "titan never overwrites a checkpoint it did not write. Resume from the newest "
                f"torchtitan step (checkpoint.load_step={max(scan.torchtitan)}), move those "
                "directories away, or use another checkpoint.folder."
            )
    return scan
