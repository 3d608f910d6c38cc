"""Handing freed heap memory back to the operating system between blocks and between a block's stages;
measuring the process's peak resident set.

glibc keeps freed medium-sized allocations (weights, mini-batch activations) in its arenas; over many blocks of
differently shaped tensors that fragmentation grows the resident set block after block. ``malloc_trim`` once per
block returns it, so the resident set between blocks stays flat. Inside a block, the freed mini-batch temporaries
of one stage would otherwise stay resident through the solve and the next stage, so trimming after each stage
lowers the block's peak, at the cost of faulting those pages in again. Elsewhere (macOS, musl) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
import sys


@functools.cache
def _libc_function(name: str):
    """A function of the C library (glibc's malloc_trim, mallopt), or None where there is none such."""
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        return getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):
        return None


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # mallopt parameters (glibc malloc.h)
MMAP_THRESHOLD_BYTES = 8 << 20
ARENA_MAX = 2
SERVING_MMAP_THRESHOLD_BYTES = 64 << 20
SERVING_TRIM_THRESHOLD_BYTES = 256 << 20


def map_large_allocations() -> None:
    """Serve every allocation of ``MMAP_THRESHOLD_BYTES`` or more from its own mapping, returned to the OS when
    freed, and cap glibc's arenas at ``ARENA_MAX`` (``mallopt``; a no-op elsewhere).

    glibc's default threshold grows to 32 MB as large blocks are freed, so a 1B model's [2048, 2048] float32
    weights (17 MB) and [rows, 2048] activations then come from the heap, where freed ones stay resident until the
    next trim. With their own mappings they go back to the OS when freed, which is what lets GPTQ of a 1B-shape
    model fit under a RAM cap; a lower threshold saves a little more memory but spends the time in page faults
    (the figures are in docs/benchmarks.md, the 1B-shape run under a RAM cap). Outputs are unchanged:
    this is where memory comes from, not what is computed.
    """
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    mallopt(_M_ARENA_MAX, ARENA_MAX)


def keep_freed_memory_for_reuse() -> None:
    """The serving engine's policy: keep freed allocations below ``SERVING_MMAP_THRESHOLD_BYTES`` in the heap
    and return its free top to the OS only past ``SERVING_TRIM_THRESHOLD_BYTES`` (``mallopt``; a no-op elsewhere).

    Every decode step allocates and frees the same few-MB temporaries once per layer (gathered KV pages, MLP
    activations, logits); with glibc's defaults the heap's free top is trimmed and faulted back in over and over.
    Keeping them trades some peak RSS (the freed temporaries stay resident for the next step) for throughput; the
    bench figures are in docs/benchmarks.md.
    Quantization sets its own policy (:func:`map_large_allocations`), so the two never mix within a command.
    """
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return
    mallopt(_M_MMAP_THRESHOLD, SERVING_MMAP_THRESHOLD_BYTES)
    mallopt(_M_TRIM_THRESHOLD, SERVING_TRIM_THRESHOLD_BYTES)


def release_freed_memory() -> None:
    """Return the heap's free pages to the OS (glibc ``malloc_trim(0)``); cheap, call between blocks."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


def peak_rss_mb() -> float:
    """This process's peak resident set, in MB (10^6 bytes, the unit of every size quantkit prints).

    On Linux, ``VmHWM`` of ``/proc/self/status``: ``ru_maxrss`` also counts the peak of the process this one
    was forked from, since the kernel carries the old address space's high-water mark over ``exec`` (a
    quantize started by a large benchmark process would report the benchmark's peak). Elsewhere ``ru_maxrss``
    (bytes on macOS).
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e6 if sys.platform == "darwin" else peak * 1024 / 1e6
