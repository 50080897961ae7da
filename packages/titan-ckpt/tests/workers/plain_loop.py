"""A plain training loop, as a torch user writes it first, checkpointed by titan-ckpt.

``plain_loop.py FOLDER STEPS OUT [KILL_AT]``: trains to step STEPS, resuming from FOLDER's
newest committed step, and writes the final state to OUT (``torch.save``); with KILL_AT,
SIGKILLs itself after computing step KILL_AT, before its save: the steps since the last
committed one are lost, as in a crash.

The states, one of each kind the manager is given as they are: a bare optimizer, an LR
scheduler, a bare module (an exponential moving average of the model) and a ``Stateful`` of
our own (the data's random generator). Each one not restored makes the resumed run differ.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from torch import nn

from titan_ckpt import CheckpointConfig, CheckpointManager


class Data:
    """The batches: drawn from a generator whose state is checkpointed."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(0)

    def batch(self) -> torch.Tensor:
        return torch.randn(4, 8, generator=self.generator)

    def state_dict(self) -> dict:
        return {"rng": self.generator.get_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.generator.set_state(state_dict["rng"])


def main(folder: str, steps: int, out: str, kill_at: int | None) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    ema = nn.Linear(8, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    data = Data()
    manager = CheckpointManager(
        CheckpointConfig(folder=folder, interval=4, keep_latest_k=0),
        model_parts=model,
        states={"optimizer": optimizer, "lr_scheduler": scheduler, "ema": ema, "data": data},
    )
    start = manager.load().step or 0
    for step in range(start + 1, steps + 1):
        model(data.batch()).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        with torch.no_grad():
            for average, value in zip(ema.parameters(), model.parameters(), strict=True):
                average.lerp_(value, 0.1)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        manager.save(step)
    manager.close()
    torch.save(
        {
            "model": model.state_dict(),
            "ema": ema.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": scheduler.state_dict(),
            "rng": data.generator.get_state(),
            "start": start,
        },
        out,
    )


if __name__ == "__main__":
    kill = int(sys.argv[4]) if len(sys.argv) > 4 else None
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], kill)
