"""Files that must stay one source although two packages hold them: titan-ckpt and
titan-optim depend on torch alone, so each holds a copy of ``titan_dims.checks`` as
``_checks.py``. A copy edited on its own would let the packages' checks drift apart."""

from __future__ import annotations

from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[1] / "packages"
SOURCE = PACKAGES / "titan-dims/src/titan_dims/checks.py"


@pytest.mark.parametrize(
    "copy", ["titan-ckpt/src/titan_ckpt/_checks.py", "titan-optim/src/titan_optim/_checks.py"]
)
def test_each_copy_of_the_config_checks_equals_titan_dims_own(copy):
    assert (PACKAGES / copy).read_bytes() == SOURCE.read_bytes(), (
        f"packages/{copy} differs from titan_dims/checks.py, their one source: edit that file "
        f"and copy it over (cp {SOURCE.relative_to(PACKAGES.parent)} packages/{copy})"
    )
