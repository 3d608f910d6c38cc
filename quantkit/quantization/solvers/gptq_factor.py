"""The Hessian side of GPTQ, in one working buffer: the damped ``H`` with its columns in processing order and dead
columns isolated, then the upper Cholesky factor ``U`` of ``H^-1`` computed in that same buffer.

This file is about memory: at K = 8192 (a 1B model's down_proj) one float32 [K, K] matrix is 268 MB, and the
straightforward chain (a clone of H, its permuted copy, L, H^-1, U) holds four or five of them at once. Here the
caller's H is only read, and besides it one buffer is held:

- the permuted copy is made row by row into the buffer, its columns then permuted a chunk of rows at a time;
- LAPACK works on column-major matrices, and torch copies a row-major input into a column-major one first.
  The working matrix is symmetric, so its transposed view ``buf.mT`` is the same matrix in column-major layout:
  the Cholesky factorization, the inverse from it and the second factorization all run in place on that view.
  The result is the column-major ``U`` torch's out-of-place calls return, with the same values bit for bit
  (tests/quantization/solvers/test_gptq_factor.py);
- given a :class:`Parking`, the caller's H itself is handed away while the factor is held.
"""

from __future__ import annotations

from typing import Protocol

import torch

_CHUNK_ELEMENTS = 1 << 23  # rows per step of the column permutation: temporaries of at most 32 MB (float32)
_FINITE_CHUNK = 1 << 20  # elements per step of the finiteness check (its temporaries: about 7 MB)


def fill_working(
    buf: torch.Tensor | None, source: torch.Tensor, perm: torch.Tensor | None, dead: torch.Tensor
) -> torch.Tensor:
    """``source`` [K, K] (float32) with rows and columns in ``perm``'s order (None: as is) and the ``dead`` columns
    (bool [K], in that order) isolated: zero rows and columns, 1 on the diagonal. Written into ``buf`` when given."""
    if perm is None:
        buf = source.clone() if buf is None else buf.copy_(source)
    else:
        buf = source[perm] if buf is None else torch.index_select(source, 0, perm, out=buf)
        step = max(1, _CHUNK_ELEMENTS // max(1, buf.shape[1]))
        for start in range(0, buf.shape[0], step):
            rows = buf[start : start + step]
            rows.copy_(rows[:, perm])
    if bool(dead.any()):
        buf[dead, :] = 0
        buf[:, dead] = 0
        buf[dead, dead] = 1
    return buf


def factor_in_place(buf: torch.Tensor) -> torch.Tensor | None:
    """The upper Cholesky factor of the inverse of ``buf`` (symmetric, already damped), computed in ``buf``'s own
    memory and returned as a column-major view of it; None when it cannot be computed (``buf`` is then spoiled)."""
    a = buf.mT  # the same symmetric matrix, column-major: LAPACK's layout, so no copy is made
    info = torch.zeros((), dtype=torch.int32, device=buf.device)
    try:
        torch.linalg.cholesky_ex(a, out=(a, info))
        if int(info) != 0 or not all_finite(buf):
            return None
        torch.cholesky_inverse(a, out=a)
        torch.linalg.cholesky_ex(a, upper=True, out=(a, info))
    except RuntimeError:  # torch.linalg.LinAlgError is a RuntimeError
        return None
    if int(info) != 0 or not all_finite(buf):
        return None
    return a


def all_finite(m: torch.Tensor) -> bool:
    """Whether every entry of ``m`` is finite, checked a chunk of rows at a time: ``torch.isfinite`` of a whole
    [K, K] matrix makes whole-matrix temporaries (a float copy and boolean masks) larger than the matrix itself."""
    rows = m.reshape(-1, m.shape[-1]) if m.ndim else m.reshape(1, 1)
    step = max(1, _FINITE_CHUNK // max(1, rows.shape[1]))
    return all(bool(torch.isfinite(rows[i : i + step]).all()) for i in range(0, rows.shape[0], step))


class Parking(Protocol):
    """Hands the caller's Hessian memory away while the factor is held, and back before it is read again (the
    run's memory strategy implements it: :mod:`quantkit.quantization.memory_strategy`)."""

    def park(self) -> None: ...

    def unpark(self) -> None: ...
