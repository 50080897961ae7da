"""Two ranks build a saving manager on a folder another process holds, synchronous and
async: every rank raises rank 0's refusal, none is left waiting in a collective.

    torchrun --nproc-per-node 2 lock_refused.py OUT_DIR FOLDER
"""

from __future__ import annotations

import sys

from common import finish, init, make_model, write_result

from titan_ckpt import CheckpointConfig, CheckpointLockError, CheckpointManager


def main() -> None:
    init()
    results: dict[str, str | None] = {}
    for mode in ("disabled", "async"):
        config = CheckpointConfig(enable=True, folder=sys.argv[2], async_mode=mode)
        try:
            CheckpointManager(config, model_parts=make_model()).close()
            results[mode] = None
        except CheckpointLockError as e:
            results[mode] = str(e)
    write_result("lock_refused", results)
    finish()


if __name__ == "__main__":
    main()
