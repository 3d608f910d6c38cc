"""gpt-oss (transformers' ``gpt_oss``): what its experts do differently from the other mixture-of-experts families.

transformers 5.22's ``GptOssExperts`` holds every expert of a layer in four fused tensors, stored under the same
names in the model's safetensors (transformers has no conversion rule for gpt_oss, unlike Qwen3-MoE or Mixtral):

- ``experts.gate_up_proj`` [E, H, 2I], applied as ``x @ W`` (in x out, the transpose of a Linear's weight), the
  gate and up projections INTERLEAVED along the last dimension (gate in the even columns, up in the odd ones), and
  ``experts.gate_up_proj_bias`` [E, 2I] interleaved the same way;
- ``experts.down_proj`` [E, I, H] (again in x out) and ``experts.down_proj_bias`` [E, H].

Each expert computes a clamped SwiGLU: ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
``down((up + 1) * gate * sigmoid(alpha * gate))`` with config.json's ``swiglu_alpha`` (1.702) and ``swiglu_limit``
(7.0). The router is a linear with a bias; each token takes the top-k logits, softmaxed among themselves.

Per-expert names (``mlp.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj``, each with a ``bias``): the names
vLLM's ``fused_moe_make_expert_params_mapping(ckpt_gate_proj_name="gate_proj", ckpt_up_proj_name="up_proj",
ckpt_down_proj_name="down_proj")`` matches (``experts.<e>.gate_proj.`` as a substring) and the same de-interleaving
llm-compressor's ``modeling/gpt_oss.py`` (``LinearExperts.copy_from_fused_weights``) applies: gate = even columns,
up = odd columns, each transposed to a Linear's [out, in]. llm-compressor nests its expert list one level deeper
(``mlp.experts.experts.<e>``, its ``LinearExperts`` replaces ``mlp.experts`` and holds ``.experts``); quantkit keeps
the one-level path every other MoE family of quantkit's writes. vLLM's gpt_oss ``load_weights`` (read 2026-11)
sends compressed-tensors checkpoints to ``_load_weights_other``, which handles the fused ``w13``/``w2`` tensors; a
per-expert integer checkpoint is not verified there (no vLLM here).

The hub checkpoints (openai/gpt-oss-20b, -120b) store the experts as MXFP4 blocks and scales ([out, in] order:
``gate_up_proj_blocks`` [E, 2I, H/32, 16] with gate/up interleaved along the rows, ``down_proj_blocks`` [E, H, I/32,
16]) and everything else in bf16: quantkit decodes each expert when it reads it (:mod:`quantkit.model.mxfp4`), so
such a checkpoint is a float source. transformers' own route (``Mxfp4Config(dequantize=True)`` then
``save_pretrained``) is no way round: 5.22 saves the dequantized experts under the ``*_blocks`` names, which neither
it nor quantkit reads back.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from quantkit.model.mxfp4 import decode_mxfp4

INTERLEAVED = "interleaved"  # MoESpec.fused_layout of gpt_oss
CLAMPED_SWIGLU = "clamped_swiglu"  # MoESpec.expert_activation of gpt_oss
GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS = "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """down_proj's input from gate's and up's outputs, as ``GptOssExperts._apply_gate`` computes it."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


BLOCKS, SCALES = "_blocks", "_scales"  # an MXFP4 source's suffixes of gate_up_proj and down_proj
FLOAT_LEAVES = (GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS)
MXFP4_LEAVES = (GATE_UP + BLOCKS, GATE_UP + SCALES, GATE_UP_BIAS, DOWN + BLOCKS, DOWN + SCALES, DOWN_BIAS)


def fused_leaves(owner: str, names: Collection[str]) -> tuple[str, ...]:
    """The fused tensors of the experts module ``owner`` that a checkpoint holding ``names`` stores."""
    return FLOAT_LEAVES if f"{owner}.{GATE_UP}" in names else MXFP4_LEAVES


def expert_part(fused: Mapping[str, torch.Tensor], expert: int, leaf: str, part: str) -> torch.Tensor:
    """One expert's Linear tensor (``leaf`` gate_proj / up_proj / down_proj, ``part`` weight / bias) from its layer's
    fused tensors ``fused`` (keyed by leaf: :data:`FLOAT_LEAVES`, or :data:`MXFP4_LEAVES` for the hub's checkpoints,
    whose weights are stored [out, in] and decoded here to the biases' dtype)."""
    column = 0 if leaf == "gate_proj" else 1  # gate: even columns (MXFP4: rows) of gate_up, up: odd ones
    if part == "bias":
        return fused[DOWN_BIAS][expert] if leaf == "down_proj" else fused[GATE_UP_BIAS][expert][column::2]
    if GATE_UP in fused:
        return fused[DOWN][expert].t() if leaf == "down_proj" else fused[GATE_UP][expert][:, column::2].t()
    proj = DOWN if leaf == "down_proj" else GATE_UP
    dtype = fused[DOWN_BIAS].dtype
    weight = decode_mxfp4(fused[proj + BLOCKS][expert], fused[proj + SCALES][expert], dtype)  # [out, in]
    return weight if leaf == "down_proj" else weight[column::2]


def derived_expert_names(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[str, int, str, str]]:
    """For a checkpoint holding gpt_oss's fused experts, float or MXFP4 (tensor name -> shape): each per-expert tensor
    name (``<layer>.mlp.experts.<e>.gate_proj.weight`` ...) -> (the fused module path, expert, leaf, part)."""
    derived: dict[str, tuple[str, int, str, str]] = {}
    for name, shape in shapes.items():
        owner, _, leaf = name.rpartition(".")
        fused = (leaf == GATE_UP and len(shape) == 3) or (leaf == GATE_UP + BLOCKS and len(shape) == 4)
        if not fused or not all(f"{owner}.{other}" in shapes for other in fused_leaves(owner, shapes)):
            continue
        for e in range(shape[0]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for part in ("weight", "bias"):
                    derived[f"{owner}.{e}.{proj}.{part}"] = (owner, e, proj, part)
    return derived


def derived_shape(shapes: Mapping[str, tuple[int, ...]], owner: str, leaf: str, part: str) -> tuple[int, ...]:
    """The shape of a per-expert tensor, from its layer's gate_up_proj [E, H, 2I] (MXFP4: blocks [E, 2I, H/32, 16])."""
    if f"{owner}.{GATE_UP}" in shapes:
        _, hidden, double = shapes[f"{owner}.{GATE_UP}"]
    else:
        _, double, groups, _ = shapes[f"{owner}.{GATE_UP}{BLOCKS}"]
        hidden = groups * 32
    inter = double // 2
    if leaf == "down_proj":
        return (hidden, inter) if part == "weight" else (hidden,)
    return (inter, hidden) if part == "weight" else (inter,)


def is_mxfp4(config: Mapping[str, Any]) -> bool:
    """Whether config.json says the experts are MXFP4 (the hub's gpt-oss; decoded on read, the rest is float)."""
    quant = config.get("quantization_config") or {}
    return isinstance(quant, Mapping) and quant.get("quant_method") == "mxfp4"


def per_expert_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a checkpoint's tensors by name) with gpt_oss's fused experts replaced by per-expert tensors (a float
    checkpoint as transformers saves it, or the hub's MXFP4 one, decoded); a state without them is returned as it is."""
    derived = derived_expert_names({name: tuple(t.shape) for name, t in state.items()})
    if not derived:
        return state
    owners = {owner: fused_leaves(owner, state) for owner, *_ in derived.values()}
    fused_names = {f"{owner}.{leaf}" for owner, leaves in owners.items() for leaf in leaves}
    out = {name: tensor for name, tensor in state.items() if name not in fused_names}
    for name, (owner, expert, leaf, part) in derived.items():
        fused = {key: state[f"{owner}.{key}"] for key in owners[owner]}
        out[name] = expert_part(fused, expert, leaf, part).contiguous()
    return out
