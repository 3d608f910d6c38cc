"""Whether the runtime's Triton kernels compile and compute right on a device, checked once per device.

On CUDA the engine's Triton backend runs five kernels: the packed W4/W8 matmul, the fused add + RMSNorm, the
KV-cache write, paged-attention decode and its partition merge. A kernel that fails to compile on a new GPU,
Triton or driver, or that computes wrong values there, would otherwise fail every request of a ``serve``.
:func:`kernels_usable` runs each kernel once on a tiny input, called as the engine calls it, against its
plain-torch reference; on an exception or a mismatch it warns in one line naming the kernel, and the backend
selection falls back to torch. The result is cached per device, so a process pays the few compilations once (the
tiny shapes share most specialisations with a real model's first steps, so little of that time is extra).

Under ``TRITON_INTERPRET=1`` the same checks run on the CPU (how the tests exercise them).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

# max|out - ref| / max|ref|: the checks look for broken kernels (wrong indexing, garbage, NaN: errors of order 1),
# not for rounding; bf16 through the CPU interpreter truncates instead of rounding, hence the margin.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
BLOCK_SIZE = 16  # the engine's default KV block size
HEAD_DIM = 64


@dataclass(frozen=True, slots=True)
class KernelCheck:
    kernel: str
    ok: bool
    error: str | None = None  # one line: the exception, or the measured error against the tolerance


@dataclass(frozen=True, slots=True)
class SelfCheck:
    device: str
    dtype: str
    checks: tuple[KernelCheck, ...]

    @property
    def usable(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[KernelCheck]:
        return [c for c in self.checks if not c.ok]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)  # inputs drawn on the CPU: the same values on every device


def _check_quant_matmul(device: torch.device, dtype: torch.dtype) -> float:
    """W4 symmetric g32 at M = 1 (a decode step) and W8 asymmetric per-channel with a bias at M = 3 (a prefill),
    scales in bfloat16 as quantize writes them."""
    from quantkit.format.pack import pack_int32
    from quantkit.runtime.kernels import quant_matmul as qm

    worst = 0.0
    for bits, group, m, symmetric in ((4, 32, 1, True), (8, -1, 3, False)):
        n, k = 48, 64
        groups = 1 if group == -1 else k // group
        g = _gen(bits)
        q = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (n, k), generator=g, dtype=torch.int32)
        packed = pack_int32(q, bits).to(device)
        scale = (torch.rand(n, groups, generator=g) * 0.02 + 0.005).to(device=device, dtype=torch.bfloat16)
        zero = None
        if not symmetric:
            zeros = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (n, groups), generator=g, dtype=torch.int32)
            zero = pack_int32(zeros, bits, dim=0).to(device)
        bias = None if symmetric else torch.randn(n, generator=g).to(device=device, dtype=dtype)
        x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
        out = qm.quant_matmul(x, packed, scale, zero, None, bits, group, bias)
        ref = qm.quant_matmul_reference(x, packed, scale, zero, None, bits, group, bias)
        worst = max(worst, _rel_err(out, ref))
    return worst


def _check_rmsnorm(device: torch.device, dtype: torch.dtype) -> float:
    """Without a residual (the first layer's input norm) and fused with the residual add (every later norm)."""
    from quantkit.runtime.kernels import rmsnorm as rn

    g = _gen(1)
    x = (torch.randn(3, 96, generator=g) * 3).to(device=device, dtype=dtype)
    residual = torch.randn(3, 96, generator=g).to(device=device, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(device=device, dtype=dtype)
    worst = 0.0
    for res in (None, residual):
        out, new_res = rn.rmsnorm(x, res, weight, 1e-5)
        ref, ref_res = rn.rmsnorm_reference(x, res, weight, 1e-5)
        worst = max(worst, _rel_err(out, ref), _rel_err(new_res, ref_res))
    return worst


def _paged_case(device: torch.device, dtype: torch.dtype, context_lens: list[int]):
    g = _gen(2)
    width = max(-(-c // BLOCK_SIZE) for c in context_lens)
    num_blocks = len(context_lens) * width + 2
    shape = (num_blocks, BLOCK_SIZE, 2, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(context_lens) * width].reshape(len(context_lens), width)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn(len(context_lens), 4, HEAD_DIM, generator=g).to(device=device, dtype=dtype)
    return q, k_cache, v_cache, tables.to(device=device, dtype=torch.int32), lens.to(device)


def _check_kv_cache_write(device: torch.device, dtype: torch.dtype) -> float:
    from quantkit.runtime.kernels import kv_cache_write as kw

    _, k_cache, v_cache, _, _ = _paged_case(device, dtype, [40])
    g = _gen(3)
    k = torch.randn(5, 2, HEAD_DIM, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(5, 2, HEAD_DIM, generator=g).to(device=device, dtype=dtype)
    slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, generator=g)[:5].to(device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kw.kv_cache_write(k, v, k_cache, v_cache, slots)
    kw.kv_cache_write_reference(k, v, ref_k, ref_v, slots)
    return max(_rel_err(k_cache, ref_k), _rel_err(v_cache, ref_v))  # a copy: exact unless broken


def _check_paged_attention(device: torch.device, dtype: torch.dtype) -> float:
    """Two sequences, one past the 512-token partition so that the merge kernel runs too."""
    from quantkit.runtime.kernels import paged_attention as pa

    q, k_cache, v_cache, tables, lens = _paged_case(device, dtype, [9, 600])
    scale = HEAD_DIM**-0.5
    out = pa.paged_attention(q, k_cache, v_cache, tables, lens, scale)
    ref = pa.paged_attention_reference(q, k_cache, v_cache, tables, lens, scale)
    return _rel_err(out, ref)


# kernel name -> check: runs the kernel on ``device`` in ``dtype`` and returns its error against the reference
CHECKS: dict[str, Callable[[torch.device, torch.dtype], float]] = {
    "quant_matmul": _check_quant_matmul,
    "rmsnorm": _check_rmsnorm,
    "kv_cache_write": _check_kv_cache_write,
    "paged_attention": _check_paged_attention,
}


def default_dtype(device: torch.device) -> torch.dtype:
    """The engine's ``auto`` dtype on CUDA (bfloat16), or float16 where the GPU has no bfloat16; float32 on CPU."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def run_checks(device: torch.device, dtype: torch.dtype | None = None) -> SelfCheck:
    """Every kernel of :data:`CHECKS` once on ``device`` (uncached)."""
    dtype = dtype or default_dtype(device)
    results = []
    for name, check in CHECKS.items():
        try:
            err = check(device, dtype)
        except Exception as exc:  # a compile or launch failure of any kind makes the kernel unusable here
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            results.append(KernelCheck(name, False, f"{type(exc).__name__}: {first[:200]}"))
            continue
        ok = err <= TOLERANCE[dtype]
        results.append(KernelCheck(name, ok, None if ok else f"error {err:.3g} > {TOLERANCE[dtype]:g} vs reference"))
    return SelfCheck(str(device), str(dtype).removeprefix("torch."), tuple(results))


_CACHE: dict[str, SelfCheck] = {}


def _device_key(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_kernels(device: torch.device) -> SelfCheck:
    """:func:`run_checks` once per device per process."""
    device = _device_key(device)
    if str(device) not in _CACHE:
        _CACHE[str(device)] = run_checks(device)
    return _CACHE[str(device)]


def kernels_usable(device: torch.device) -> bool:
    """True when every kernel passed its check on ``device``; else one warning naming the failed kernels."""
    result = check_kernels(device)
    if not result.usable:
        reasons = "; ".join(f"{c.kernel} ({c.error})" for c in result.failed)
        warnings.warn(
            f"Triton kernel check failed on {result.device}: {reasons}; using the torch backend instead",
            RuntimeWarning,
            stacklevel=2,
        )
    return result.usable
