"""CI's share of the integration matrix (``integration_tests/matrix.py``; ``hatch run
integration`` runs all of it): the rows marked ``ci``, layouts and features that the other
integration tests do not train through the real command (HSDP, an interleaved pipeline
schedule, gradient accumulation), each against one process's losses."""

from __future__ import annotations

import pytest

from matrix import ROWS, Matrix

CI_ROWS = [name for name, row in ROWS.items() if row.ci and row.reference]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> Matrix:
    return Matrix(tmp_path_factory.mktemp("matrix"))


def test_the_ci_subset_is_representative():
    assert {"hsdp", "pp_interleaved_1f1b", "grad_accumulation"} <= set(CI_ROWS)
    assert all(ROWS[name].nproc <= 4 for name in CI_ROWS)  # CI machines have 2 cores


@pytest.mark.parametrize("name", CI_ROWS)
def test_row(matrix, name):
    passed, detail = matrix.run(name, echo=lambda line: None)
    assert passed, f"{name}: {detail}"
