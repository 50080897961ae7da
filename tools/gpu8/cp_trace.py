"""Count the host-to-device copies and the host syncs of one profiled context-parallel step
(issue 18, F6: CP positions built on the host and the ring's ``mask.any()`` cost one copy or
one sync per attention layer). Reads a rank's Chrome trace written by titan-train's profiler
and passes when both counts stay below the number of attention layers: a few per step (the
batch, the loss) are fine, one per layer is the regression.

    python tools/gpu8/cp_trace.py TRACE.json N_LAYERS
"""

from __future__ import annotations

import json
import sys
from collections import Counter

COPY = ("Memcpy HtoD", "cudaMemcpyAsync", "hipMemcpyAsync")
SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
        "hipStreamSynchronize", "hipDeviceSynchronize")  # fmt: skip


def count(trace: dict) -> Counter:
    """Events of the trace whose name starts with one of COPY or SYNC, by kind."""
    counts: Counter = Counter()
    for event in trace.get("traceEvents", []):
        name = str(event.get("name", ""))
        if name.startswith(COPY) and ("HtoD" in name or "Memcpy" in name):
            # cudaMemcpyAsync is counted only for host-to-device copies (its args say so).
            kind = str(event.get("args", {}).get("kind", "HtoD"))
            if "HtoD" in name or "HtoD" in kind or kind == "1":
                counts["host-to-device copies"] += 1
        elif name.startswith(SYNC):
            counts["host syncs"] += 1
    return counts


def main(path: str, n_layers: int) -> int:
    with open(path) as f:
        counts = count(json.load(f))
    copies, syncs = counts["host-to-device copies"], counts["host syncs"]
    ok = copies < n_layers and syncs < n_layers
    print(
        f"{path}: {copies} host-to-device copies, {syncs} host syncs in the profiled step(s) "
        f"({n_layers} attention layers): {'ok' if ok else 'one per layer or more'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
