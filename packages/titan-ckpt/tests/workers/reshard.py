"""Save under FSDP2 at one world size, load at another; report losses and full tensors.

Usage (under torchrun): reshard.py OUT_DIR PHASE FOLDER [ASYNC_FOLDER]
- PHASE "save": train 2 steps, save step 2, train on, load step 2 back (round trip); then
  train to step 4 and save it, with rank 1 killed (SIGKILL) after writing its shard, before
  the save completes. torchrun tears the job down; step-4 stays uncommitted.
- PHASE "load": load the newest committed step into a differently initialized model; then,
  per async mode (thread; writer process), train, save to ASYNC_FOLDER/<mode>, keep training
  while it is written, and load it back.
One script for both, so the suite starts as few torch processes as it can.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from common import (
    DataPosition,
    TrainState,
    eval_loss,
    finish,
    full_params,
    init,
    make_model,
    shard,
    train_steps,
    write_result,
)
from torch.distributed.checkpoint import FileSystemWriter

from titan_ckpt import CheckpointConfig, CheckpointManager, LocalStorage, OptimizerState


class DyingWriter(FileSystemWriter):
    """Writes this rank's files, then kills the process before DCP can finish the save."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        future.wait()
        os.kill(os.getpid(), signal.SIGKILL)
        return future


class DyingStorage(LocalStorage):
    def dcp_writer(self, path):
        return DyingWriter(path)


def optimizer_sums(opt_state: OptimizerState) -> dict[str, float]:
    out = {}
    for k, v in opt_state.state_dict().items():
        if isinstance(v, torch.Tensor):
            t = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[k] = float(t.double().sum())
    return out


def build(seed: int, folder: str, async_mode: str = "disabled"):
    model = shard(make_model(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    opt_state = OptimizerState(model, opt)
    train_state = TrainState()
    data = DataPosition()
    data.position = 2
    config = CheckpointConfig(
        enable=True, folder=folder, interval=2, keep_latest_k=0, async_mode=async_mode
    )
    manager = CheckpointManager(
        config,
        model_parts=[model],
        states={"optimizer": opt_state, "train_state": train_state, "dataloader": data},
    )
    return model, opt, opt_state, train_state, manager


def same_as_torch_state_dicts(model, opt, model_state, opt_state) -> bool:
    """Whether the manager's model and optimizer states (their FQN keys learned in earlier
    saves, titan_ckpt.states) hold what torch's functions give now: the same keys in the
    same order, views of the same tensors (DTensor shards here), the same plain values."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from titan_ckpt.states import _same_tensor

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    pairs = [
        (model_state.state_dict(), get_model_state_dict(model)),
        (opt_state.state_dict(), get_optimizer_state_dict(model, opt, options=flat)),
    ]
    return all(
        list(ours) == list(theirs)
        and all(
            _same_tensor(a, b) if isinstance(a, torch.Tensor) else a == b
            for a, b in zip(ours.values(), theirs.values(), strict=True)
        )
        for ours, theirs in pairs
    )


def main() -> None:
    rank = init()
    phase, folder = sys.argv[2], sys.argv[3]
    if phase == "save":
        model, opt, opt_state, train_state, manager = build(0, folder)
        train_steps(model, opt, range(1, 3), rank)
        train_state.step = 2
        assert manager.save(2)
        saved = {
            "loss": eval_loss(model),
            "params": full_params(model),
            "opt": optimizer_sums(opt_state),
        }
        train_steps(model, opt, range(3, 4), rank)
        moved = eval_loss(model)
        loaded = bool(manager.load())
        manager.close()
        write_result(
            "save",
            {
                **saved,
                "loss_after_more_training": moved,
                "loaded": loaded,
                "loss_after_load": eval_loss(model),
                "params_after_load": full_params(model),
            },
        )
        train_steps(model, opt, range(3, 5), rank)
        train_state.step = 4
        dying = CheckpointManager(
            manager.config,
            model_parts=[model],
            states={"optimizer": opt_state, "train_state": train_state},
            storage=DyingStorage() if rank == 1 else LocalStorage(),
        )
        dying.save(4)  # rank 1 dies in here; torchrun stops the others
        write_result("unexpected", {"step": 4})
    else:
        model, opt, opt_state, train_state, manager = build(1, folder)
        fresh_loss = eval_loss(model)
        loaded = bool(manager.load())
        manager.close()
        result = {
            "fresh_loss": fresh_loss,
            "loaded": loaded,
            "step": train_state.step,
            "loss": eval_loss(model),
            "params": full_params(model),
            "opt": optimizer_sums(opt_state),
        }
        for mode in ("async", "async_with_pinned_mem"):
            async_folder = os.path.join(sys.argv[4], mode)
            model, opt, opt_state, train_state, manager = build(0, async_folder, mode)
            train_steps(model, opt, range(1, 3), rank)
            assert manager.save(2)
            manager.maybe_wait_for_staging()
            # Training (FSDP collectives included) changes the weights while the write runs.
            train_steps(model, opt, range(3, 5), rank)
            assert manager.save(4)
            # No maybe_wait_for_staging: the optimizer's copy may still run in the background
            # (of its whole state with async, of everything with async_with_pinned_mem); the
            # step pre-hook makes step 5's optimizer step wait for it.
            expected, expected_opt = eval_loss(model), optimizer_sums(opt_state)
            same_as_torch = same_as_torch_state_dicts(model, opt, manager.model, opt_state)
            train_steps(model, opt, range(5, 6), rank)
            manager.close()
            reader = CheckpointManager(
                CheckpointConfig(enable=True, folder=async_folder),
                model_parts=[model],
                states={"optimizer": opt_state, "train_state": train_state},
            )
            reader.load()
            reader.close()
            result[mode] = {
                "expected": expected,
                "loaded": eval_loss(model),
                "expected_opt": expected_opt,
                "loaded_opt": optimizer_sums(opt_state),
                "same_as_torch": same_as_torch,
            }
        write_result("load", result)


if __name__ == "__main__":
    main()
    finish()
