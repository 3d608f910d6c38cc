"""User-facing errors: each message names the problem and the fix.

The CLI turns a ``QuantkitError`` into one red line and a non-zero exit; library users catch it like any
``ValueError``. ``assert`` stays reserved for internal invariants.
"""

from __future__ import annotations


class QuantkitError(ValueError):
    """A problem with the user's input or environment that the user can fix."""


class UnsupportedArchitectureError(QuantkitError):
    """The model's architecture is not in the architecture table."""


class CalibrationError(QuantkitError):
    """Calibration data is missing, empty, or does not fit the request."""
