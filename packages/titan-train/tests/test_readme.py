"""The README's python example runs as written."""

import re
from pathlib import Path

import pytest
import torch.distributed as dist

README = Path(__file__).parents[1] / "README.md"


BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_the_data_and_the_custom_loop_examples():
    assert len(BLOCKS) == 2
    assert "train_step(run, batches)" in BLOCKS[1]


@pytest.mark.parametrize("block", BLOCKS, ids=["data", "custom_loop"])
def test_readme_example_runs(block, capsys):
    exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    assert not dist.is_initialized()
