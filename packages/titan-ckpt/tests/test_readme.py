"""The README's example runs as written, and so do its `titan-ckpt` command lines."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_first_example_resumes_after_the_last_committed_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = compile(_python_blocks()[0], str(README), "exec")
    first: dict = {"__name__": "readme"}
    exec(code, first)
    assert first["start"] == 0
    steps = sorted(p.name for p in (tmp_path / "checkpoint").glob("step-*"))
    assert steps == ["step-10", "step-15", "step-20", "step-5"]
    # Killed while step 20 was being written: it has no commit marker.
    (tmp_path / "checkpoint" / "step-20" / "titan-commit.json").unlink()
    again: dict = {"__name__": "readme"}
    exec(code, again)
    assert again["start"] == 15


def test_readme_other_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = _python_blocks()[1:]
    assert len(blocks) == 1
    for block in blocks:
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})


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
