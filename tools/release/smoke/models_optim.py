"""titan-models and titan-optim together, in one process: a tiny Llama 3 takes 3 AdamW steps.

python models_optim.py
"""

import torch

from titan_models.llama3 import Llama3, llama3_args
from titan_optim import OptimizerConfig, build_optimizers

args = llama3_args("debugmodel", dim=64, n_layers=2, n_heads=4, vocab_size=256)
torch.manual_seed(0)
model = Llama3(args)
model.init_weights()
optimizers = build_optimizers([model], OptimizerConfig(name="AdamW", lr=1e-2))
tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
losses = []
for _ in range(3):
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizers.step()
    optimizers.zero_grad()
    losses.append(loss.item())
assert losses[-1] < losses[0], losses
print(f"models+optim smoke ok: losses {[round(x, 4) for x in losses]}")
