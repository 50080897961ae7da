"""The README's FSDP2 example, run as users would: under torchrun with 1 and 2 processes.

Both must print the same five losses (sharding must not change the math), and they must fall.
"""

import re
from pathlib import Path

import pytest

from titan_dims.testing import run_torchrun

README = Path(__file__).parents[1] / "README.md"


def _losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)$", output, re.MULTILINE)]


@pytest.fixture
def example(tmp_path) -> Path:
    (code,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    script = tmp_path / "train.py"
    script.write_text(code)
    return script


def test_readme_fsdp_example_matches_across_world_sizes(example):
    one = _losses(run_torchrun(example, 1, timeout=180).stdout)
    two = _losses(run_torchrun(example, 2, timeout=180).stdout)
    assert len(one) == 5
    assert two == pytest.approx(one, rel=1e-5)
    assert one[-1] < one[0] * 0.8
