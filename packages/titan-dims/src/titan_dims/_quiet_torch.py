"""Import torch without its "Failed to initialize NumPy" warning where NumPy is not installed.

titan-dims needs no NumPy, and torch-only environments (``pip install titan-dims``) have none:
torch then warns at import that it could not load it, a line every ``titan-dims`` command
printed that nobody can act on. The console script imports this package, and so torch,
before ``titan_dims.cli`` runs, so the filter lives here, scoped to torch's import and to
that one message. Where NumPy is installed but broken the warning stays: that one says
something.
"""

import warnings

try:
    import numpy  # noqa: F401  (torch imports it anyway)
except ImportError:
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Failed to initialize NumPy", category=UserWarning
        )
        import torch  # noqa: F401
