"""Two ranks that both hold the whole model (as tensor-parallel ranks share one data
stream) save step 1 twice: once with a dataloader of data-parallel degree 1 (its
``dp_degree``), once of degree 2.

    torchrun --nproc-per-node 2 save_dp.py OUT_DIR FOLDER
"""

from __future__ import annotations

import os
import sys

from common import DataPosition, finish, init, make_model

from titan_ckpt import CheckpointConfig, CheckpointManager


def main() -> None:
    init()
    folder = sys.argv[2]
    model = make_model()
    for degree in (1, 2):
        data = DataPosition(supports_resharding=False, dp_degree=degree)
        data.position = 7
        config = CheckpointConfig(
            enable=True, folder=os.path.join(folder, f"dp{degree}"), interval=1
        )
        with CheckpointManager(config, model_parts=model, states={"dataloader": data}) as manager:
            manager.save(1)


if __name__ == "__main__":
    main()
    finish()
