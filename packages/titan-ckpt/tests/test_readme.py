"""The README's example runs as written, and so do its `titan-ckpt` command lines."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_python_block_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], str(README), "exec"), {"__name__": "readme"})


def test_readme_command_lines_run(saved_folder, tmp_path, monkeypatch, titan_ckpt):
    import shlex
    import shutil

    block = re.search(r"```console\n(.*?)```", README.read_text(), flags=re.S)
    assert block is not None
    lines = [ln[2:] for ln in block.group(1).splitlines() if ln.startswith("$ titan-ckpt ")]
    assert len(lines) == 8
    shutil.copytree(saved_folder, tmp_path / "checkpoint")
    monkeypatch.chdir(tmp_path)
    for line in lines:
        args = shlex.split(line, comments=True)[1:]
        code, out, err = titan_ckpt(*args)
        assert code == 0, (line, out, err)
