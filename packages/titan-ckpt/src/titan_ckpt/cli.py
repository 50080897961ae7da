"""The ``titan-ckpt`` command's former home: ``titan_ckpt.commands.cli`` is the command now.

Kept so that ``python -m titan_ckpt.cli`` and entry-point scripts installed before the move
keep working.
"""

from __future__ import annotations

import sys

from titan_ckpt.commands.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
