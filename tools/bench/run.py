"""Run a titan benchmark by name: ``python tools/bench/run.py NAME [ARGS...]``.

Each benchmark is a script beside this one (``dims_mesh.py``, ...) with its own ``--help``.
Benchmarks run on demand and print ratios measured side by side in one run; tests never
assert timings.
"""

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).parent


def available() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.py") if p.stem not in {"run", "__init__"})


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] in {"-h", "--help"}:
        print(__doc__)
        print("benchmarks:", ", ".join(available()))
        return 0 if len(sys.argv) >= 2 else 2
    name = sys.argv[1]
    if name not in available():
        print(
            f"run.py: unknown benchmark {name!r}; choose from {', '.join(available())}",
            file=sys.stderr,
        )
        return 2
    sys.argv = [str(HERE / f"{name}.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
