"""The ``titan-dims`` command: plan a parallel layout for any world size.

    titan-dims plan --world-size 4096 --tp 8 --pp 4 --rank 1234
    titan-dims plan --world-size 131072 --tp 8 --pp 16 --dp-replicate 4 --json
    titan-dims plan --world-size 64 --ep 8 --rank 9          # MoE: EP borrows from dp_shard

The mesh is built for real, by torch, on a fake process group seen from ``--rank``, so the
rank groups printed are the ones a job of that size would get. Bad degrees print one error
with a valid alternative and exit with status 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any

from titan_dims.__about__ import __version__
from titan_dims.errors import ParallelDimsError
from titan_dims.parallel_dims import ParallelDims
from titan_dims.simulate import simulate

__all__ = ["main"]

_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")

_PURPOSE = {
    "pp": "pipeline stages",
    "dp_replicate": "model replicas (DDP / HSDP replicate)",
    "dp_shard": "parameter sharding (FSDP)",
    "dp_shard_mod_ep": "FSDP shards outside an EP group",
    "dp_shard_in_ep": "FSDP shards lent to EP",
    "cp": "sequence split (context parallel)",
    "tp": "tensor parallel",
    "dp": "data loading: distinct batches",
    "dp_shard_cp": "parameter sharding (FSDP)",
    "dp_cp": "loss and gradient reduction",
    "ep": "expert parallel",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="titan-dims",
        description="Plan and inspect parallel layouts (pp, dp_replicate, dp_shard, cp, tp, ep).",
    )
    parser.add_argument("--version", action="version", version=f"titan-dims {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    examples = [line.strip() for line in (__doc__ or "").splitlines() if line.startswith("    ")]
    plan = commands.add_parser(
        "plan",
        epilog="examples:\n" + "\n".join(f"  {line}" for line in examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="show the mesh, its sub-meshes and a rank's process groups",
        description=textwrap.fill(
            "Validate the degrees, build the DeviceMesh on a fake process group and print "
            "each dimension and flattened sub-mesh with its size; with --rank, that rank's "
            "coordinates and the ranks in each of its groups.",
            width=88,
        ),
    )
    plan.add_argument("--world-size", type=int, required=True, help="number of ranks")
    for flag, default, text in (
        ("--dp-replicate", 1, "model replicas (DDP, HSDP replicate)"),
        ("--dp-shard", -1, "FSDP shard degree; -1 takes the ranks left over"),
        ("--cp", 1, "context-parallel degree"),
        ("--tp", 1, "tensor-parallel degree"),
        ("--pp", 1, "pipeline-parallel degree"),
        ("--ep", 1, "expert-parallel degree (borrowed from dp_shard x cp)"),
    ):
        plan.add_argument(flag, type=int, default=default, help=f"{text} (default {default})")
    plan.add_argument("--rank", type=int, default=None, help="show this rank's groups")
    plan.add_argument("--json", action="store_true", help="print JSON for scripts")
    plan.add_argument(
        "--max-ranks",
        type=int,
        default=16,
        help="in text output, list at most this many ranks of a group (default 16)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``titan-dims``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        dims = ParallelDims(
            world_size=args.world_size, **{name: getattr(args, name) for name in _DEGREES}
        )
        if args.rank is not None and not 0 <= args.rank < dims.world_size:
            raise ParallelDimsError(
                f"--rank {args.rank} is outside the world of {dims.world_size} ranks "
                f"(valid: 0 to {dims.world_size - 1})."
            )
    except ParallelDimsError as error:
        print(f"titan-dims: error: {error}", file=sys.stderr)
        return 2
    report = _plan(dims, args.rank)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_render(report, max_ranks=args.max_ranks))
    return 0


def _plan(dims: ParallelDims, rank: int | None) -> dict[str, Any]:
    layout = dims.layout
    report: dict[str, Any] = {
        "world_size": dims.world_size,
        "degrees": {n: getattr(dims, n) for n in _DEGREES},
        "dims": [
            {"name": n, "size": s} for n, s in zip(layout.dim_names, layout.dim_sizes, strict=True)
        ],
        "flattened": [
            {"name": n, "size": layout.size(n), "dims": list(srcs)}
            for n, srcs in layout.flattened.items()
        ],
        "enabled": [
            name
            for name in ("dp_replicate", "dp_shard", "fsdp", "cp", "dp_cp", "tp", "pp", "ep")
            if getattr(dims, f"{name}_enabled")
        ],
        "dp_degree": dims.dp_degree,
        "non_data_parallel_size": dims.non_data_parallel_size,
        "seq_len_divisor": dims.seq_len_divisor,
        "dense_params_mesh_ndim": dims.dense_params_mesh_ndim,
    }
    started = time.perf_counter()
    with simulate(dims, rank=rank or 0) as simulated:
        groups = {name: simulated.get_mesh(name).mesh.flatten().tolist() for name in layout.names}
    report["simulated_mesh_seconds"] = round(time.perf_counter() - started, 3)
    if rank is not None:
        report["rank"] = {
            "rank": rank,
            "coordinates": layout.coordinates(rank),
            "dp_rank": dims.dp_rank(rank),
            "groups": groups,
        }
    return report


def _render(report: dict[str, Any], *, max_ranks: int) -> str:
    degrees = ", ".join(f"{n}={v}" for n, v in report["degrees"].items() if v > 1)
    lines = [f"world_size {report['world_size']}: {degrees or 'a single rank'}", ""]
    lines.append("mesh dimensions, outermost to innermost:")
    if not report["dims"]:
        lines.append("  (none: one rank needs no mesh dimension)")
    for dim in report["dims"]:
        lines.append(f"  {dim['name']:<16}{dim['size']:>8}   {_PURPOSE[dim['name']]}")
    lines += ["", "flattened sub-meshes:"]
    if not report["flattened"]:
        lines.append("  (none)")
    for flat in report["flattened"]:
        merged = " x ".join(flat["dims"])
        lines.append(f"  {flat['name']:<16}{flat['size']:>8}   {_PURPOSE[flat['name']]} = {merged}")
    lines += [
        "",
        f"enabled: {', '.join(report['enabled']) or 'nothing (one rank)'}",
        f"data-parallel degree {report['dp_degree']}, non-data-parallel size "
        f"{report['non_data_parallel_size']}, seq_len must divide by "
        f"{report['seq_len_divisor']}",
        f"built by torch on a fake process group in {report['simulated_mesh_seconds']} s",
    ]
    if "rank" in report:
        info = report["rank"]
        coords = " ".join(f"{n}={c}" for n, c in info["coordinates"].items()) or "(none)"
        lines += [
            "",
            f"rank {info['rank']}: {coords}; loads data shard {info['dp_rank']} "
            f"of {report['dp_degree']}",
        ]
        for name, ranks in info["groups"].items():
            lines.append(f"  {name:<16}{len(ranks):>8}   {format_ranks(ranks, max_ranks)}")
    return "\n".join(lines)


def format_ranks(ranks: Sequence[int], max_ranks: int = 16) -> str:
    """Ranks as a short string: ``0-7``, ``3, 7, ..., 4095 (every 4th)`` or a plain list."""
    steps = {b - a for a, b in itertools.pairwise(ranks)}
    if len(ranks) > 2 and steps == {1}:
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) <= max_ranks:
        return ", ".join(map(str, ranks))
    if len(steps) == 1:
        return f"{ranks[0]}, {ranks[1]}, ..., {ranks[-1]} (every {steps.pop()})"
    head = ", ".join(map(str, ranks[: max_ranks // 2]))
    tail = ", ".join(map(str, ranks[-2:]))
    return f"{head}, ..., {tail}"


if __name__ == "__main__":
    sys.exit(main())
