"""The presets and where each loads, as docs/formats.md shows them: rendered from the presets
(:mod:`quantkit.format.presets`) and the engine table (:mod:`quantkit.format.engines`, and
:mod:`quantkit.format.moe_engines` for routed experts), so the page cannot drift from the rules ``quantize`` checks
and ``inspect`` reports (tests/format/test_engines.py and tests/format/test_moe_engines.py compare the two)."""

from __future__ import annotations

from quantkit.format.engines import kv_cache_support, layout_problem, transformers_support, vllm_kernel
from quantkit.format.float_engines import CAPABILITIES, CAPABILITY_NAMES
from quantkit.format.moe_engines import moe_method, moe_refusal, vllm_moe_kernel
from quantkit.format.presets import PRESETS
from quantkit.format.scheme import ActivationScheme, KVCacheScheme, QuantScheme
from quantkit.format.scheme_labels import activation_format, kv_cache_format, weight_format

# a layer every preset holds (K and N multiples of every group and block): the table shows each preset's kernels
# where its layout is valid; the K column says which layers that is
SHAPE = 4096
_K_PROBE = 1024  # larger than any group or block a preset takes


def k_multiple(scheme: QuantScheme) -> int:
    """The in-features a scheme needs a multiple of: the smallest K the layout rules accept (their divisors' least
    common multiple, 1 when any K is taken)."""
    return next(k for k in range(1, _K_PROBE + 1) if layout_problem(scheme, k) is None)


def _k_rule(scheme: QuantScheme) -> str:
    multiple = k_multiple(scheme)
    if multiple == 1:
        return "any"
    # the fallback policy gives an integer layer a smaller group; a float format's group is its own
    return f"x{multiple}" if scheme.is_float else f"x{multiple} (else a smaller group)"


def _cell(label: str) -> str:
    return label.replace("|", "/")


def presets_markdown() -> str:
    """One row per preset: weights, activations, the K it needs, and the kernel transformers and vLLM (per GPU
    generation) load a layer of that preset with; then the FP8 KV cache's attention backends."""
    gpus = [f"vLLM {CAPABILITY_NAMES[c]} (sm{c})" for c in CAPABILITIES]
    head = ["preset", "weights", "activations", "K", "transformers", *gpus]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, scheme in PRESETS.items():
        kernels = [vllm_kernel(scheme, SHAPE, SHAPE, c).label for c in CAPABILITIES]
        row = [f"`{name}`", weight_format(scheme), activation_format(scheme.activations), _k_rule(scheme)]
        row += [transformers_support(scheme, SHAPE).label, *kernels]
        lines.append("| " + " | ".join(map(_cell, row)) + " |")
    lines += ["", "| `--kv-cache-scheme` | cache | " + " | ".join(gpus) + " |", "|" + "---|" * (2 + len(gpus))]
    for flag, strategy in (("fp8", "tensor"), ("fp8-head", "attn_head")):
        kv = KVCacheScheme(strategy=strategy)
        backends = [kv_cache_support(kv, c).label for c in CAPABILITIES]
        lines.append("| " + " | ".join(map(_cell, [f"`{flag}`", kv_cache_format(kv), *backends])) + " |")
    return "\n".join(lines)


# the routed experts the MoE table shows each kernel for: Qwen3-235B-A22B's (hidden 4096, expert width 1536), which
# every preset's groups, blocks and tiles divide; the H and I columns say which sizes a scheme needs
MOE_HIDDEN, MOE_INTERMEDIATE = 4096, 1536
# layouts outside the presets that a vLLM MoE rule turns on (--group-size, --sym, --act-order, --static-groups)
MOE_EXTRA_ROWS: tuple[QuantScheme, ...] = (
    QuantScheme(bits=4, group_size=256),
    QuantScheme(bits=8, group_size=128, symmetric=False),
    QuantScheme(bits=4, group_size=32, act_order=True),
    QuantScheme(bits=8, group_size=-1, type="float", activations=ActivationScheme("float", 8, "tensor", False)),
)


def moe_multiple(scheme: QuantScheme, dim: str) -> int | None:
    """The hidden size (``dim="hidden"``) or expert width (``"intermediate"``) vLLM's MoE rules need a multiple of:
    the smallest the rules accept beside a size every rule takes for the other; None when the scheme is refused."""
    for size in range(1, _K_PROBE + 1):
        shape = (size, MOE_INTERMEDIATE * 2) if dim == "hidden" else (MOE_HIDDEN, size)
        if moe_refusal(scheme, *shape) is None:
            return size
    return None


def _multiple_label(scheme: QuantScheme, dim: str) -> str:
    multiple = moe_multiple(scheme, dim)
    return "-" if multiple is None else "any" if multiple == 1 else f"x{multiple}"


def moe_markdown() -> str:
    """One row per preset (and per extra layout a MoE rule concerns): the vLLM MoE method that loads a layer's routed
    experts of that scheme, the hidden size H and expert width I it needs, and its kernel per GPU generation."""
    gpus = [f"vLLM {CAPABILITY_NAMES[c]} (sm{c})" for c in CAPABILITIES]
    head = ["experts", "weights", "activations", "MoE method", "H", "I", *gpus]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = [*((f"`{name}`", scheme) for name, scheme in PRESETS.items()), *((s.name, s) for s in MOE_EXTRA_ROWS)]
    for label, scheme in rows:
        kernels = [vllm_moe_kernel(scheme, c, MOE_HIDDEN, MOE_INTERMEDIATE).label for c in CAPABILITIES]
        row = [label, weight_format(scheme), activation_format(scheme.activations), f"`{moe_method(scheme)}`"]
        row += [_multiple_label(scheme, "hidden"), _multiple_label(scheme, "intermediate"), *kernels]
        lines.append("| " + " | ".join(map(_cell, row)) + " |")
    return "\n".join(lines)
