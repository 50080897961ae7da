"""Record torchtitan's own logits from the recorded step-N checkpoint, on the recorded batch.

Builds the tiny Llama 3 with torchtitan's own model code (July 2025, commit 6204cdff9,
imported as ``shared/anchors/torchtitan-cpu/tt_cpu_launch.py`` imports it: device detection
answers "cpu" while torchtitan imports), loads the model weights of
``checkpoint/step-N/`` (torchtitan's DCP files, unchanged) and runs it on the batch of step
N + 1 kept in ``reference.pt``: the cross entropy of its logits there must be the loss
torchtitan's trainer recorded, so the model is the one of torchtitan's run.

Then it runs the same model on ``LENGTH`` tokens (that batch's ids, repeated) and writes
``logits.pt``: ``{"inputs": [1, LENGTH] ids, "positions": [16] indices, "logits": fp32
[1, 16, vocab]}``, the first and last 8 positions only (the file stays small). Far
positions are what tell RoPE variants apart: on this tiny, briefly trained model plain and
Llama 3.1-scaled RoPE differ by ~1e-6 in the logits within the run's 32 positions, by
~2e-5 near position 1,000 (torchtitan's rotary table has a row for every position up to
``max_seq_len``; the rows do not depend on it, so the run's 32 are among them). The
checkpoint and the other files are read, never written. ``record.py`` runs this at the
end of a recording; alone (in torchtitan's venv, from anywhere)::

    TT_VENV/bin/python tools/torchtitan_reference/record_logits.py \
        --torchtitan TT_DIR --data packages/titan-train/tests/torchtitan/data
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

LENGTH = 1024
KEPT = 8  # positions kept at each end


def import_torchtitan(checkout: str):
    """torchtitan's Llama 3 model module, imported with device detection answering "cpu"."""
    import torch
    import torch._utils

    sys.path.insert(0, str(Path(checkout).resolve()))
    detect = torch._utils._get_available_device_type
    torch._utils._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils as tt_utils
        from torchtitan.models.llama3.model import args, model
    finally:
        torch._utils._get_available_device_type = detect
    if tt_utils.device_type != "cpu":
        raise SystemExit(f"torchtitan imported with device {tt_utils.device_type!r}, not cpu")
    return args, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torchtitan", required=True, help="extracted torchtitan checkout")
    parser.add_argument("--data", required=True, help="the folder record.py wrote")
    options = parser.parse_args()
    data = Path(options.data).resolve()

    import torch
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as functional

    tt_args, tt_model = import_torchtitan(options.torchtitan)
    meta = json.loads((data / "reference.json").read_text())
    shape = {k: meta["model"][k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads")}
    model_args = tt_args.TransformerModelArgs(
        **shape,
        multiple_of=meta["model"]["multiple_of"],
        vocab_size=meta["model"]["vocab_size"],
        rope_theta=meta["model"]["rope_theta"],
        max_seq_len=LENGTH,
    )
    torch.manual_seed(0)
    model = tt_model.Transformer(model_args)
    # torchtitan's checkpoint keeps the model's keys at the top level, without freqs_cis.
    state = {k: v for k, v in model.state_dict().items() if k != "freqs_cis"}
    step = data / "checkpoint" / f"step-{meta['checkpoint_step']}"
    dcp.load(state, checkpoint_id=str(step), no_dist=True)
    model.load_state_dict(state, strict=False)
    model.eval()

    reference = torch.load(data / "reference.pt", weights_only=True)
    with torch.no_grad():
        logits = model(reference["inputs"]).float()
        loss = functional.cross_entropy(logits.flatten(0, 1), reference["labels"].flatten())
        if abs(float(loss) - float(reference["loss"])) > 1e-5:
            raise SystemExit(f"loss {float(loss)} is not torchtitan's {float(reference['loss'])}")
        inputs = reference["inputs"].flatten().repeat(LENGTH // reference["inputs"].numel() + 1)
        inputs = inputs[None, :LENGTH].clone()
        positions = torch.cat([torch.arange(KEPT), torch.arange(LENGTH - KEPT, LENGTH)])
        logits = model(inputs).float()[:, positions].clone()
    torch.save({"inputs": inputs, "positions": positions, "logits": logits}, data / "logits.pt")
    print(f"logits {tuple(logits.shape)} (loss {float(loss):.6f}) -> {data / 'logits.pt'}")


if __name__ == "__main__":
    main()
