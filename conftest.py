"""Settings for the whole test suite (pytest loads this file for every test path below it).

The suite is written for CPU and gloo: its tolerances, process counts (2 to 8 local ranks)
and timings assume them. On a machine with a GPU, device detection would pick CUDA, so rank
1 of a 2-process test on a one-GPU host would ask for a second device, and the assertions
tuned for CPU would run on CUDA. Pin the device to CPU unless the caller chose one
(``TITAN_DEVICE=cuda pytest ...``); the GPU paths have their own script (tools/gpu_smoke.sh).
Subprocesses (torchrun workers, the real commands) inherit it.
"""

import os

os.environ.setdefault("TITAN_DEVICE", "cpu")


def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` every test that launches ranks through a ``run_torchrun`` fixture
    (directly or through the fixtures it uses): the `alone` environments leave them out."""
    import pytest

    for item in items:
        if "run_torchrun" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
