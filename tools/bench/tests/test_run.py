"""``hatch run bench`` (tools/bench/run.py) without a name: each benchmark on its own line
with a one-line description from its docstring, no reST markup; an unknown name lists them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).parents[1] / "run.py"


@pytest.fixture
def run(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_run", RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def call(*args):
        monkeypatch.setattr(sys, "argv", [str(RUN), *args])
        return module.main()

    return call


def test_listing_has_a_line_per_benchmark(run, capsys):
    assert run("--help") == 0
    out = capsys.readouterr().out
    assert "``" not in out
    lines = out.split("benchmarks:\n", 1)[1].splitlines()
    names = sorted(p.stem for p in RUN.parent.glob("*.py") if p.stem != "run")
    assert [line.split()[0] for line in lines] == names
    assert "  dims_mesh " in out
    assert "How long titan-dims takes to build and slice a mesh" in out
    assert all(len(line.split(maxsplit=1)) == 2 and len(line) <= 120 for line in lines)


def test_unknown_benchmark_lists_them(run, capsys):
    assert run("nosuch") == 2
    err = capsys.readouterr().err
    assert err.startswith("run.py: unknown benchmark 'nosuch'; choose one of:\n")
    assert "  vs_torchtitan " in err
