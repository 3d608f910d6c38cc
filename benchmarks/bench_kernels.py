"""Benchmark the runtime Triton kernels against torch baselines and the memory-bandwidth bound.

For SmolLM2-135M shapes (hidden 576, intermediate 1536, 9 heads / 3 kv heads, head dim 64) and Llama-7B shapes
(4096x4096, 4096x11008, 11008x4096; 32 heads, head dim 128), decode batch sizes and one prefill size:

- quant_matmul (W4/W8 packed) vs a dense fp16 ``x @ W^T``;
- paged_attention vs ``scaled_dot_product_attention`` on already-gathered contiguous K/V;
- kv_cache_write vs ``index_copy_``; fused add+RMSNorm vs the eager torch version.

"bound" is bytes moved / measured device-to-device copy bandwidth; "%bw" = bound / kernel time. Timings are
CUDA events around each call with warmup; the L2 cache is flushed before every timed call unless --no-flush. With
--graph each call is timed inside a CUDA graph instead: the kernel's own time, without the host's launch cost.
CUDA only: on a machine without a GPU it prints a message and exits 0 (the Triton interpreter is not timed).

    python -m benchmarks.bench_kernels --help
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

SMOL = {
    "name": "smollm2",
    "linears": [("qkv", 576, 576 + 2 * 192), ("o", 576, 576), ("gate_up", 576, 2 * 1536), ("down", 1536, 576)],
    "attn": (9, 3, 64),
    "hidden": 576,
}
DEVICE = "cuda"  # module-level so the case builders can be smoke-tested elsewhere
LLAMA7B = {
    "name": "llama7b",
    "linears": [
        ("4096x4096", 4096, 4096),
        ("4096x11008", 4096, 11008),
        ("11008x4096", 11008, 4096),
        ("4096x32000", 4096, 32000),  # the head (kept in float by quantize; its shape as a W4 bound)
    ],
    "attn": (32, 32, 128),
    "hidden": 4096,
}


@dataclass
class Timer:
    """CUDA-event timer: median milliseconds per call."""

    warmup: int
    reps: int
    flush: bool

    def __post_init__(self) -> None:
        self._l2 = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=DEVICE) if self.flush else None

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            if self._l2 is not None:
                self._l2.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


@dataclass
class GraphTimer:
    """CUDA-graph timer: the kernel's own time, without the host's launch cost (what a decode step captured in a CUDA
    graph pays). ``calls`` calls are captured in one graph, each after an L2 flush when ``flush``; the flushes alone
    are captured in a second graph, and the median replay time of the first minus the second's, over ``calls``, is
    the per-call time in ms. A call that cannot be captured (a host synchronisation) is timed by ``fallback``."""

    warmup: int
    reps: int
    flush: bool
    calls: int = 10

    def __post_init__(self) -> None:
        self._l2 = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=DEVICE) if self.flush else None
        self.fallback = Timer(self.warmup, self.reps, self.flush)
        self.failures: list[str] = []
        self._flush_ms: float | None = None

    def _capture(self, fn: Callable[[], object] | None) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (compile, allocator) off the capture, as torch's docs advise
            for _ in range(max(1, self.warmup)):
                if fn is not None:
                    fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.calls):
                if self._l2 is not None:
                    self._l2.zero_()
                if fn is not None:
                    fn()
        return graph

    def _replay_ms(self, graph: torch.cuda.CUDAGraph) -> float:
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def __call__(self, fn: Callable[[], object]) -> float:
        try:
            graph = self._capture(fn)
        except Exception as exc:  # not capturable: the event timer's figure, and the reason kept for the report
            torch.cuda.synchronize()
            self.failures.append(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}")
            return self.fallback(fn)
        if self._flush_ms is None:
            self._flush_ms = self._replay_ms(self._capture(None)) if self._l2 is not None else 0.0
        return max(self._replay_ms(graph) - self._flush_ms, 1e-6) / self.calls


def copy_bandwidth(timer: Timer) -> float:
    """Device-to-device copy bandwidth in bytes/ms (read + write counted)."""
    src = torch.empty(512 * 1024 * 1024, dtype=torch.int8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() / ms


def make_quant_weight(n: int, k: int, bits: int, group_size: int, device: str) -> dict[str, torch.Tensor | None]:
    """Random packed weight in the checkpoint layout (symmetric, no act-order)."""
    from quantkit.format.pack import pack_int32

    group = k if group_size == -1 else group_size
    q = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (n, k), dtype=torch.int32)
    packed = pack_int32(q, bits).to(device)
    scale = (torch.rand(n, math.ceil(k / group)) * 0.01 + 0.001).half().to(device)
    return {"weight_packed": packed, "weight_scale": scale, "weight_zero_point": None, "g_idx": None}


def make_paged_case(bsz: int, ctx: int, hq: int, hkv: int, d: int, block_size: int, device: str):
    """Random cache with shuffled pages; every sequence has ``ctx`` tokens."""
    pages_per_seq = math.ceil(ctx / block_size)
    num_blocks = bsz * pages_per_seq
    q = torch.randn(bsz, hq, d, dtype=torch.float16, device=device)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, dtype=torch.float16, device=device)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=device).reshape(bsz, pages_per_seq).to(torch.int32)
    lens = torch.full((bsz,), ctx, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables, lens


def bench_quant_matmul(timer, bw, model, ms_list, bits, group_size, rows) -> None:
    from quantkit.runtime.kernels.quant_matmul import quant_matmul

    for lname, k, n in model["linears"]:
        wq = make_quant_weight(n, k, bits, group_size, DEVICE)
        w16 = torch.randn(n, k, dtype=torch.float16, device=DEVICE)
        for m in ms_list:
            x = torch.randn(m, k, dtype=torch.float16, device=DEVICE)
            t_tr = timer(lambda x=x, wq=wq: quant_matmul(x, **wq, bits=bits, group_size=group_size))
            t_fp = timer(lambda x=x, w16=w16: x @ w16.t())
            wbytes = wq["weight_packed"].numel() * 4 + wq["weight_scale"].numel() * 2
            nbytes = wbytes + 2 * m * k + 2 * m * n
            rows.append(("quant_matmul", f"{model['name']} {lname} w{bits}g{group_size}", m, t_tr, t_fp, nbytes / bw))


def bench_paged_attention(timer, bw, model, batches, ctx, block_size, rows) -> None:
    import torch.nn.functional as F

    from quantkit.runtime.kernels.paged_attention import paged_attention

    hq, hkv, d = model["attn"]
    for bsz in batches:
        q, kc, vc, bt, lens = make_paged_case(bsz, ctx, hq, hkv, d, block_size, DEVICE)
        scale = d**-0.5
        t_tr = timer(
            lambda q=q, kc=kc, vc=vc, bt=bt, lens=lens, scale=scale: paged_attention(q, kc, vc, bt, lens, scale)
        )
        # baseline: SDPA on contiguous, already gathered K/V (gather cost excluded)
        kg = kc[bt.long()].reshape(bsz, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
        vg = vc[bt.long()].reshape(bsz, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
        qs = q[:, :, None, :]
        t_sdpa = timer(
            lambda qs=qs, kg=kg, vg=vg, scale=scale: F.scaled_dot_product_attention(
                qs, kg, vg, scale=scale, enable_gqa=hq != hkv
            )
        )
        nbytes = 2 * bsz * ctx * hkv * d * 2 + 2 * 2 * bsz * hq * d
        rows.append(("paged_attention", f"{model['name']} H{hq}/{hkv} D{d} ctx{ctx}", bsz, t_tr, t_sdpa, nbytes / bw))


def bench_small_kernels(timer, bw, model, tokens_list, block_size, rows) -> None:
    from quantkit.runtime.kernels.kv_cache_write import kv_cache_write, kv_cache_write_reference
    from quantkit.runtime.kernels.rmsnorm import rmsnorm, rmsnorm_reference

    _, hkv, d = model["attn"]
    h = model["hidden"]
    for t in tokens_list:
        num_blocks = math.ceil(4 * t / block_size) + 1
        k = torch.randn(t, hkv, d, dtype=torch.float16, device=DEVICE)
        v = torch.randn_like(k)
        kc = torch.zeros(num_blocks, block_size, hkv, d, dtype=torch.float16, device=DEVICE)
        vc = torch.zeros_like(kc)
        slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:t]
        t_tr = timer(lambda k=k, v=v, kc=kc, vc=vc, slots=slots: kv_cache_write(k, v, kc, vc, slots))
        t_ref = timer(lambda k=k, v=v, kc=kc, vc=vc, slots=slots: kv_cache_write_reference(k, v, kc, vc, slots))
        rows.append(("kv_cache_write", f"{model['name']} Hkv{hkv} D{d}", t, t_tr, t_ref, 2 * 2 * k.numel() * 2 / bw))

        x = torch.randn(t, h, dtype=torch.float16, device=DEVICE)
        res = torch.randn_like(x)
        w = torch.ones(h, dtype=torch.float16, device=DEVICE)
        t_tr = timer(lambda x=x, res=res, w=w: rmsnorm(x, res, w, 1e-5))
        t_ref = timer(lambda x=x, res=res, w=w: rmsnorm_reference(x, res, w, 1e-5))
        rows.append(("add+rmsnorm", f"{model['name']} H{h}", t, t_tr, t_ref, 4 * x.numel() * 2 / bw))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=["smollm2", "llama7b"], default=["smollm2", "llama7b"])
    parser.add_argument(
        "--kernels", nargs="+", choices=["matmul", "attention", "small"], default=["matmul", "attention", "small"]
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="decode batch sizes")
    parser.add_argument("--prefill", type=int, default=512, help="prefill rows (tokens) for matmul/small kernels")
    parser.add_argument("--bits", type=int, choices=[4, 8], default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--context", type=int, default=1024, help="context length per sequence for attention")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache page size")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--no-flush", action="store_true", help="do not flush L2 before each timed call")
    parser.add_argument(
        "--graph",
        action="store_true",
        help="time each call inside a CUDA graph (the kernel's own time, no host launch cost), both sides",
    )
    parser.add_argument("--json", type=Path, help="also write every row (times in ms) and the bandwidth here")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device; the Triton kernels are only timed on a GPU (nothing to do).")
        return 0

    from rich.console import Console
    from rich.table import Table

    events = Timer(args.warmup, args.reps, flush=not args.no_flush)
    bw = copy_bandwidth(events)
    timer = GraphTimer(args.warmup, args.reps, flush=not args.no_flush) if args.graph else events
    console = Console()
    console.print(f"[bold]{torch.cuda.get_device_name()}[/]: device-to-device copy bandwidth {bw / 1e6:.0f} GB/s")
    models = [m for m in (SMOL, LLAMA7B) if m["name"] in args.models]
    rows: list[tuple[str, str, int, float, float, float]] = []
    for model in models:
        if "matmul" in args.kernels:
            bench_quant_matmul(timer, bw, model, [*args.batches, args.prefill], args.bits, args.group_size, rows)
        if "attention" in args.kernels:
            bench_paged_attention(timer, bw, model, args.batches, args.context, args.block_size, rows)
        if "small" in args.kernels:
            bench_small_kernels(timer, bw, model, [*args.batches, args.prefill], args.block_size, rows)

    table = Table(title="Triton kernels vs torch baseline and bandwidth bound (times in µs)")
    for col in ("kernel", "shape", "M/B/T", "triton", "torch", "bound", "torch/triton", "%bw"):
        table.add_column(col, justify="left" if col in ("kernel", "shape") else "right")
    for kernel, shape, m, t_tr, t_ref, bound in rows:
        table.add_row(
            kernel,
            shape,
            str(m),
            f"{t_tr * 1e3:.1f}",
            f"{t_ref * 1e3:.1f}",
            f"{bound * 1e3:.1f}",
            f"{t_ref / t_tr:.2f}x",
            f"{100 * bound / t_tr:.0f}%",
        )
    console.print(table)
    console.print("torch baselines: fp16 dense matmul; SDPA on pre-gathered K/V; index_copy_; eager add+RMSNorm.")
    if args.graph:
        console.print("times: per call inside a CUDA graph (no host launch cost), the L2 flushes subtracted.")
        for failure in timer.failures:
            console.print(f"[yellow]not capturable, timed with events instead:[/] {failure}")
    if args.json is not None:
        write_json(args.json, torch.cuda.get_device_name(), bw, rows, vars(args))
    return 0


def write_json(path: Path, device: str, bw: float, rows: list, options: dict) -> None:
    """Every row as an object: times in ms, ``speedup`` torch/triton, ``bandwidth_fraction`` bound/triton."""
    keys = ("kernel", "shape", "m", "triton_ms", "torch_ms", "bound_ms")
    records = [dict(zip(keys, row, strict=True)) for row in rows]
    for r in records:
        r["speedup"], r["bandwidth_fraction"] = r["torch_ms"] / r["triton_ms"], r["bound_ms"] / r["triton_ms"]
    shown = {k: (str(v) if isinstance(v, Path) else v) for k, v in options.items()}
    summary = {"device": device, "copy_bandwidth_gb_s": bw / 1e6, "options": shown, "rows": records}
    path.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
