"""Run a titan benchmark by name: ``python tools/bench/run.py NAME [ARGS...]``.

Each benchmark is a script beside this one (``dims_mesh.py``, ...) with its own ``--help``.
Benchmarks run on demand and print ratios measured side by side in one run; tests never
assert timings.
"""

import ast
import re
import runpy
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).parent


def available() -> list[str]:
    """The benchmarks' names: the scripts beside this one."""
    return sorted(p.stem for p in HERE.glob("*.py") if p.stem not in {"run", "__init__"})


def summary(name: str) -> str:
    """The first sentence of benchmark ``name``'s module docstring, as plain text on one line
    (read without importing the script: some import torch or start processes)."""
    doc = ast.get_docstring(ast.parse((HERE / f"{name}.py").read_text())) or ""
    paragraph = " ".join(doc.split("\n\n", 1)[0].split()).replace("``", "")
    sentence = re.split(r"(?<=[.:])\s", paragraph, maxsplit=1)[0].rstrip(".:")
    return textwrap.shorten(sentence, width=92, placeholder=" ...")


def listing() -> str:
    """Every benchmark on a line of its own, with its summary."""
    names = available()
    width = max(map(len, names))
    return "\n".join(f"  {name:<{width}}  {summary(name)}" for name in names)


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] in {"-h", "--help"}:
        print((__doc__ or "").replace("``", ""))
        print(f"benchmarks:\n{listing()}")
        return 0 if len(sys.argv) >= 2 else 2
    name = sys.argv[1]
    if name not in available():
        print(
            f"run.py: unknown benchmark {name!r}; choose one of:\n{listing()}",
            file=sys.stderr,
        )
        return 2
    sys.argv = [str(HERE / f"{name}.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
