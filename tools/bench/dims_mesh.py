"""How long titan-dims takes to build and slice a mesh of 1k to 131k ranks, in one process.

    python tools/bench/dims_mesh.py [--world-sizes 1024 16384 131072] [--tp 8] [--pp 8]

For each world size, in a fresh process (so peak memory is that size's alone): the time to
build the real DeviceMesh with every flattened sub-mesh on a fake process group, the time to
slice every named sub-mesh, the peak resident memory, and beside them the time the pure
MeshLayout arithmetic takes to answer the same group questions. Target: 131,072 ranks
planned in under 2 s.
"""

import argparse
import json
import subprocess
import sys
import time


def measure(world_size: int, tp: int, pp: int) -> dict:
    import resource

    import torch  # noqa: F401  (import cost is not part of the measurement)

    from titan_dims import ParallelDims, simulate

    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dims = ParallelDims(world_size=world_size, tp=tp, pp=pp, dp_replicate=2)
    rank = world_size - 1
    started = time.perf_counter()
    with simulate(dims, rank=rank) as simulated:
        built = time.perf_counter()
        groups = {n: simulated.get_mesh(n).mesh.flatten().tolist() for n in dims.layout.names}
        sliced = time.perf_counter()
    started_arith = time.perf_counter()
    arith = {n: dims.layout.group(n, rank) for n in dims.layout.names}
    arith_seconds = time.perf_counter() - started_arith
    if arith != groups:
        raise SystemExit(f"MeshLayout and torch disagree at world_size={world_size}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "world_size": world_size,
        "layout": str(dims),
        "build_s": built - started,
        "slice_s": sliced - built,
        "plan_s": sliced - started,
        "arith_s": arith_seconds,
        "peak_rss_delta_mib": (peak - base_rss) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1024, 16384, 131072])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.tp, args.pp)))
        return
    print(
        f"{'world':>8} {'build s':>8} {'slice s':>8} {'plan s':>8} {'arith s':>8} "
        f"{'torch/arith':>11} {'peak MiB':>9}  layout"
    )
    for world_size in args.world_sizes:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                str(world_size),
                "--tp",
                str(args.tp),
                "--pp",
                str(args.pp),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        r = json.loads(out.strip().splitlines()[-1])
        ratio = r["plan_s"] / max(r["arith_s"], 1e-9)
        print(
            f"{r['world_size']:>8} {r['build_s']:>8.3f} {r['slice_s']:>8.3f} {r['plan_s']:>8.3f} "
            f"{r['arith_s']:>8.4f} {ratio:>10.0f}x {r['peak_rss_delta_mib']:>9.1f}  {r['layout']}"
        )


if __name__ == "__main__":
    main()
