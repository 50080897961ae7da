"""The README's examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) == 2
    for block in blocks:
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "parameters, loss" in out
    assert "MoE max share" in out
