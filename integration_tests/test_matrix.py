"""The integration matrix's share in the test suite (``integration_tests/matrix.py``; ``hatch
run integration`` runs all of it): the rows marked ``ci``, layouts and features that the
other integration tests do not train through the real command (HSDP, an interleaved pipeline
schedule, gradient accumulation), each against one process's losses; and the SFT story end
to end (``sft_chat_qwen3``: HF Qwen3 -> SFT with document masking on the chat sample -> HF
export -> ``titan-train generate --chat`` -> transformers, the same greedy tokens). CI runs
gradient accumulation; the others are ``full`` (beside the marker, or in the root
conftest.py, the CI test that keeps each one's promise)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# The suite imports in importlib mode: load the runner beside this file by its path.
_spec = importlib.util.spec_from_file_location(
    "titan_matrix", Path(__file__).with_name("matrix.py")
)
_matrix = importlib.util.module_from_spec(_spec)
sys.modules["titan_matrix"] = _matrix  # dataclasses look their module up by name
_spec.loader.exec_module(_matrix)
ROWS, Matrix = _matrix.ROWS, _matrix.Matrix

CI_ROWS = [name for name, row in ROWS.items() if row.ci and row.reference]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> Matrix:
    return Matrix(tmp_path_factory.mktemp("matrix"))


def test_the_ci_subset_is_representative():
    assert {"hsdp", "pp_interleaved_1f1b", "grad_accumulation"} <= set(CI_ROWS)
    assert all(ROWS[name].nproc <= 4 for name in CI_ROWS)  # CI machines have 2 cores


# HSDP (4 processes) trains like one process in titan-models' four-rank layout tests (llama3,
# qwen3, deepseek_v3), CI's; through the real command it is `full`.
FULL_ROWS = {"hsdp"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.full) if n in FULL_ROWS else n for n in CI_ROWS]
)
def test_row(matrix, name):
    passed, detail = matrix.run(name, echo=lambda line: None)
    assert passed, f"{name}: {detail}"


@pytest.mark.slow
def test_sft_chat_qwen3_end_to_end(matrix):
    """A tiny Qwen3 made by transformers, fine-tuned on the chat sample with document masking
    (one process), exported with ``titan-ckpt convert --to hf``: ``titan-train generate
    --chat`` from the step and from the export, and transformers' greedy ``generate`` on the
    export from its ``apply_chat_template`` ids, give the same prompt ids and tokens."""
    pytest.importorskip("transformers")
    passed, detail = matrix.run("sft_chat_qwen3", echo=lambda line: None)
    assert passed, f"sft_chat_qwen3: {detail}"
