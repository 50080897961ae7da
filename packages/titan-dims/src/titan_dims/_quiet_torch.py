"""Import torch without its "Failed to initialize NumPy" warning where NumPy is not installed.

titan-dims needs no NumPy, and torch warns at import when it has none: a line every
``titan-dims`` command printed that nobody can act on. The filter is scoped to torch's
import and that one message (a broken NumPy still warns)."""

import warnings

try:
    import numpy  # noqa: F401  (torch imports it anyway)
except ImportError:
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Failed to initialize NumPy", category=UserWarning
        )
        import torch  # noqa: F401
