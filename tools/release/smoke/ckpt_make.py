"""Write a small committed titan-ckpt checkpoint with the library (one process).

    python ckpt_make.py FOLDER

Then the rehearsal runs ``titan-ckpt verify`` and ``titan-ckpt inspect --json`` on it.
"""

import sys

import torch
from torch import nn

from titan_ckpt import CheckpointConfig, CheckpointManager, OptimizerState

folder = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
manager = CheckpointManager(
    CheckpointConfig(enable=True, folder=folder, interval=1, last_save_model_only=False),
    model_parts=[model],
    states={"optimizer": OptimizerState(model, optimizer)},
)
model(torch.randn(4, 8)).pow(2).mean().backward()
optimizer.step()
assert manager.save(1, force=True)
manager.close()
print(f"ckpt smoke: wrote {folder}/step-1")
