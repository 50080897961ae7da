"""``titan-ckpt inspect ... | head`` ends quietly: a reader that closes the pipe early gets no
BrokenPipeError traceback on stderr, and the command's status is 141 (128 + SIGPIPE), as for
any program that SIGPIPE ends. Checked in a real shell pipeline, on a report far larger than
the pipe's buffer, so that writing really fails."""

from __future__ import annotations

import shlex
import subprocess
import sys

import torch
from safetensors.torch import save_file


def test_inspect_into_a_closed_pipe_ends_quietly(tmp_path):
    path = tmp_path / "many.safetensors"
    # ~3,000 tensors make a report of ~200 KB: more than the 64 KiB a pipe holds, so the
    # command is still writing when `head` exits.
    save_file({f"layers.{i}.a_long_tensor_name": torch.zeros(2) for i in range(3000)}, path)
    command = (
        f"{shlex.quote(sys.executable)} -m titan_ckpt.commands.cli inspect {shlex.quote(str(path))}"
    )
    result = subprocess.run(
        ["bash", "-c", f'{command} | head -1; echo "status=${{PIPESTATUS[0]}}" >&2'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout.startswith("safetensors checkpoint ")
    assert len(result.stdout.splitlines()) == 1
    assert result.stderr == "status=141\n"
