"""Record the name and shape of every parameter and persistent buffer of torchtitan's own
DeepSeek-V3 (July 2025, commit 6204cdff9), built on the meta device for its flavors.

titan's DeepSeek-V3 must have the same names and shapes, so torchtitan's checkpoints load
into it unchanged; ``packages/titan-models/tests/deepseek_v3/test_model.py`` compares them
with what this writes. Nothing is allocated (meta device), so even 671B takes seconds.
Run it in torchtitan's venv (torchtitan is imported, never edited)::

    PYTHONPATH=TT_DIR TT_VENV/bin/python tools/torchtitan_reference/record_deepseek_v3.py \
        --out packages/titan-models/tests/deepseek_v3/data/torchtitan_fqns.json

The file holds, per flavor: ``parameters`` and ``buffers`` (name -> shape, the buffers
those in the state dict, i.e. persistent) and torchtitan's own total parameter count
(``DeepSeekV3ModelArgs.get_nparams_and_flops``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

FLAVORS = ("debugmodel", "16B", "236B", "671B")
COMMIT = "6204cdff9"


def record(flavor: str) -> dict:
    import torch
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_configs

    args = deepseekv3_configs[flavor]
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    parameters = {name: list(p.shape) for name, p in model.named_parameters()}
    buffers = {
        name: list(t.shape) for name, t in model.state_dict().items() if name not in parameters
    }
    nparams, _ = args.get_nparams_and_flops(model, seq_len=args.max_seq_len)
    return {"parameters": parameters, "buffers": buffers, "num_params": nparams}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    options = parser.parse_args()

    import torchtitan

    checkout = Path(torchtitan.__file__).resolve().parent.parent
    head = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    data = {
        "torchtitan_commit": head or COMMIT,
        "flavors": {flavor: record(flavor) for flavor in FLAVORS},
    }
    out = Path(options.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}: {', '.join(FLAVORS)}")


if __name__ == "__main__":
    main()
