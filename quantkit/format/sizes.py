"""Sizes as quantkit shows them: one unit everywhere, the megabyte, 1 MB = 10^6 bytes (never MiB).

``quantize``, ``inspect``, ``plan``, ``export`` and the recipe report print sizes through :func:`format_mb` (or
:func:`mb_number` under a column headed "MB"), so a size reads the same wherever it appears.
"""

from __future__ import annotations

BYTES_PER_MB = 1_000_000
BITS_PER_MB = 8 * BYTES_PER_MB


def megabytes(nbytes: float) -> float:
    """``nbytes`` in MB (10^6 bytes)."""
    return nbytes / BYTES_PER_MB


def mb_number(nbytes: float, decimals: int | None = None) -> str:
    """The size in MB without the unit, for a column headed "MB": one decimal from 1 MB, three significant digits
    below; ``decimals`` fixes the decimals instead (budgets a user types back, e.g. ``--max-size-mb``)."""
    mb = megabytes(nbytes)
    if decimals is not None:
        return f"{mb:.{decimals}f}"
    return f"{mb:.1f}" if mb >= 1 or mb == 0 else f"{mb:.3g}"


def format_mb(nbytes: float, decimals: int | None = None) -> str:
    """``nbytes`` as text in MB, e.g. ``270.9 MB`` or ``0.0412 MB`` (``decimals``: as :func:`mb_number`)."""
    return f"{mb_number(nbytes, decimals)} MB"
