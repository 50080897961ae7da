"""Start-up hook of the restart tests (``integration_tests/test_restarts.py``): Python imports
``sitecustomize`` from its path when it starts, and those tests put this folder on the
PYTHONPATH of the run they launch. Anywhere else, and in every process that is not a torchrun
worker or has no ``TITAN_FAULT_PLAN``, it does nothing. The work is in ``titan_faults``."""

import os

if os.environ.get("TITAN_FAULT_PLAN") and "LOCAL_RANK" in os.environ:
    try:
        import titan_faults

        titan_faults.install()
    except BaseException:  # Python would only print one line and go on without the faults
        import traceback

        traceback.print_exc()
        os._exit(99)
