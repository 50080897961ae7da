"""``titan-train`` with one rank that stops answering: rank ``HANG_RANK`` (default 1) sleeps
``HANG_SECONDS`` (default 120) before training step ``HANG_STEP`` (default 3), so its peers
wait in a collective past ``comm.train_timeout_seconds``. Launch it under torchrun the way
titan-train's ``--nproc-per-node`` does:

    python -m torch.distributed.run --standalone --nproc-per-node 8 \\
        tools/gpu8/hang_rank.py train --comm.train_timeout_seconds 30 ...

What to expect (issue 18, F20/F21): the run ends with a non-zero status, the peers' NCCL
watchdog reports the timed-out collective, and the flight recorder writes its traces under
``<dump_folder>/comm_traces/``.
"""

from __future__ import annotations

import os
import sys
import time

import titan_train.trainer.loop as trainer
from titan_train.cli import main

HANG_RANK = int(os.environ.get("HANG_RANK", "1"))
HANG_STEP = int(os.environ.get("HANG_STEP", "3"))
HANG_SECONDS = float(os.environ.get("HANG_SECONDS", "120"))

_train_step = trainer.train_step


def _hanging_train_step(run, batches):
    # train_state.step is the step before this one: train_step advances it first.
    if int(os.environ.get("RANK", "0")) == HANG_RANK and run.train_state.step + 1 == HANG_STEP:
        print(f"hang_rank: rank {HANG_RANK} sleeps {HANG_SECONDS:.0f} s before step {HANG_STEP}")
        sys.stdout.flush()
        time.sleep(HANG_SECONDS)
    return _train_step(run, batches)


trainer.train_step = _hanging_train_step  # the loop calls it through the trainer module

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
