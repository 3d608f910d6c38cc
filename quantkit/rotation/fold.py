"""Folding orthogonal rotations into a decoder's float weights, one block at a time.

With the residual stream rotated (x' = x Q, row vectors) and the RMSNorm scales absorbed into the linears that read
the norms' outputs (a norm multiplies each channel by offset + w, ``ArchSpec.norm_offset``; folded, it stores
w = 1 - offset and multiplies by one), every linear that reads the residual gets W' = (W ⊙ s) Q, every linear that
writes it W' = Q^T W (bias' = bias Q), the embedding E' = E Q and the head W' = (W ⊙ s_final) Q. A per-head
rotation R between v_proj and o_proj turns each kv head's rows of v_proj into R^T W_v[h] and each attention head's
columns of o_proj into W_o[:, h] R (not where the attention output is gated elementwise before o_proj). A hybrid
model's layers differ in their token mixer: each block is folded under its own layer's spec (``ArchSpec.for_layer``).
Everything is computed in float64, in row chunks, and stored back in the weights' dtype; nothing needs more than
one block, so a model larger than memory can be streamed.
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.model.architectures import DOWN, GATE_UP, O_PROJ, QKV, ArchSpec
from quantkit.model.blocks import get_module
from quantkit.rotation.norms import check_rmsnorm, norm_scale, unit_weight

_CHUNK_ELEMENTS = 1 << 22  # float64 temporaries of at most 32 MiB
_V_PROJ = "v_proj"  # the qkv linear whose output rows the head rotation turns


def rotate_rows(x: torch.Tensor, rotation: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """(x ⊙ scale[None, :]) @ rotation for a 2-D ``x``, in float64 chunks of rows; result in x's dtype/device."""
    rotation = rotation.to(device=x.device, dtype=torch.float64)
    scale = None if scale is None else scale.detach().to(device=x.device, dtype=torch.float64)
    out = torch.empty(x.shape[0], rotation.shape[1], dtype=x.dtype, device=x.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, x.shape[1]))
    for start in range(0, x.shape[0], step):
        rows = x[start : start + step].detach().to(torch.float64)
        out[start : start + step] = ((rows if scale is None else rows * scale) @ rotation).to(x.dtype)
    return out


def rotate_embedding(weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The embedding [vocab, hidden] for the rotated residual stream: E Q."""
    return rotate_rows(weight, residual)


def rotate_head(
    head_weight: torch.Tensor, final_norm_weight: torch.Tensor, residual: torch.Tensor, norm_offset: float = 0.0
) -> torch.Tensor:
    """The lm_head [vocab, hidden] with the final norm's scale absorbed: (W ⊙ (norm_offset + w_final)) Q. The caller
    sets the final norm's weight to ``unit_weight(norm_offset)``; with tied embeddings ``head_weight`` is the original
    (unrotated) embedding and the result must be stored as a separate, untied head."""
    return rotate_rows(head_weight, residual, scale=norm_scale(final_norm_weight, norm_offset))


def head_rotation_refusal(arch: ArchSpec) -> str | None:
    """Why the per-head rotation between v_proj and o_proj cannot fold into ``arch``'s layers (None: it can)."""
    if arch.gated_attention_output:
        return (
            f"{arch.family} multiplies each attention output elementwise by a learned gate before the output "
            "projection, which a per-head rotation does not commute with"
        )
    return None


def _inside(arch: ArchSpec, module_path: str) -> tuple[str, ...]:
    return tuple(name for name in arch.float_linears if name.startswith(f"{module_path}."))


def _norm_readers(arch: ArchSpec) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(block norm, the linears that read its output): norms[0] is read by the qkv stage and the float linears inside
    the token mixer (a gated DeltaNet's in_proj_b / in_proj_a), norms[1] by gate_up and the float linears inside the
    MLP (a mixture of experts' router and shared expert gate). Float linears stay float: folding is exact there."""
    mixer, mlp = _inside(arch, arch.attn_path), _inside(arch, arch.mlp_path)
    stray = set(arch.float_linears) - set(mixer) - set(mlp)
    if stray:  # a float linear whose input the table does not say: folding it behind either norm may be wrong
        raise QuantkitError(
            f"cannot fold a rotation: the {arch.family} float linears {sorted(stray)} sit neither in "
            f"'{arch.attn_path}' nor in '{arch.mlp_path}'; check the architecture entry"
        )
    return (arch.norms[0], arch.stage(QKV).linears + mixer), (arch.norms[1], arch.stage(GATE_UP).linears + mlp)


def _residual_writers(arch: ArchSpec) -> tuple[str, ...]:
    """o_proj and every down_proj (a mixture of experts has one per expert: stages ``down.<e>``)."""
    downs = tuple(name for stage in arch.stages if stage.name.partition(".")[0] == DOWN for name in stage.linears)
    return arch.stage(O_PROJ).linears + downs


def _float_linear(block: nn.Module, path: str, hidden: int, dim: int) -> nn.Module:
    """The linear at ``path``, checked to be a float [out, in] weight whose ``dim`` has the hidden size."""
    try:
        module = get_module(block, path)
    except AttributeError:
        raise QuantkitError(
            f"cannot fold a rotation: the block has no module '{path}'; check the architecture"
        ) from None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or not weight.is_floating_point() or weight.is_meta:
        raise QuantkitError(
            f"cannot fold a rotation into '{path}': it is not a loaded float linear; fold rotations into the float "
            "model before quantizing it"
        )
    if weight.shape[dim] != hidden:
        side = "input" if dim == 1 else "output"
        raise QuantkitError(
            f"cannot fold a rotation into '{path}': its {side} size is {weight.shape[dim]}, not the hidden size "
            f"{hidden}; check the architecture entry"
        )
    return module


def check_foldable(block: nn.Module, arch: ArchSpec) -> None:
    """Raise a QuantkitError naming what keeps rotations from folding into ``block`` (``arch``: its layer's spec):
    norms on the sub-blocks' outputs, a block norm that is no RMSNorm of the declared form, or a linear that is
    missing, quantized, or of the wrong shape."""
    assert not arch.mixers, "a hybrid model's block folds under its layer's spec (ArchSpec.for_layer)"
    if arch.sandwich_norms is not None:
        after_attn, after_mlp = arch.sandwich_norms
        raise QuantkitError(
            f"cannot fold a rotation into {arch.family}: its sandwich norms '{after_attn}' and '{after_mlp}' scale "
            "the attention's and the MLP's outputs channel by channel before the residual add, where no linear can "
            "absorb their weights; quantize it without a rotation (--rotate none)"
        )
    for norm_path in arch.norms[:2]:
        try:
            norm = get_module(block, norm_path)
        except AttributeError:
            raise QuantkitError(f"cannot fold a rotation: the block has no norm '{norm_path}'") from None
        check_rmsnorm(norm, norm_path, arch.norm_offset)
    hidden = get_module(block, arch.norms[0]).weight.shape[0]
    for _, readers in _norm_readers(arch):
        for path in readers:
            _float_linear(block, path, hidden, dim=1)
    for path in _residual_writers(arch):
        _float_linear(block, path, hidden, dim=0)


def _rotate_heads(block: nn.Module, arch: ArchSpec, head: torch.Tensor) -> None:
    """R^T W_v[h] for every kv head's rows of v_proj (bias b_h R), W_o[:, h] R for every head's columns of o_proj."""
    d = head.shape[0]
    attn_head_dim = getattr(get_module(block, arch.attn_path), "head_dim", d)
    if attn_head_dim != d:
        raise QuantkitError(f"the head rotation has size {d} but the attention's head_dim is {attn_head_dim}")
    v_weight, v_bias = _value_rows(block, arch, d)
    o = get_module(block, arch.stage(O_PROJ).head)
    kv_out, hidden = v_weight.shape
    if kv_out % d or o.weight.shape[1] % d:
        raise QuantkitError(f"v_proj/o_proj sizes {kv_out}/{o.weight.shape[1]} are not multiples of head_dim {d}")
    kv = kv_out // d
    per_head = v_weight.reshape(kv, d, hidden).transpose(1, 2).reshape(kv * hidden, d)  # rows of W_v[h]^T
    rotated = rotate_rows(per_head, head).view(kv, hidden, d).transpose(1, 2).reshape(kv_out, hidden)
    v_weight.copy_(rotated)
    if v_bias is not None:
        v_bias.copy_(rotate_rows(v_bias.view(kv, d), head).view(-1))
    o.weight.copy_(rotate_rows(o.weight.reshape(-1, d), head).reshape(o.weight.shape))


def _value_rows(block: nn.Module, arch: ArchSpec, d: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The value projection's weight rows and bias (views, written in place): v_proj's own, or the last
    ``kv_heads * head_dim`` rows of a fused qkv_proj (Phi-3 stacks q, k, v in that order)."""
    v_path = next((p for p in arch.stage(QKV).linears if p.rpartition(".")[2] == _V_PROJ), None)
    if v_path is not None:
        v = get_module(block, v_path)
        return v.weight, v.bias
    qkv = arch.stage(QKV).linears
    kv_heads = getattr(get_module(block, arch.attn_path), "num_key_value_heads", None)
    if len(qkv) != 1 or kv_heads is None:
        raise QuantkitError(f"the {arch.family} qkv stage has no {_V_PROJ}; disable rotate_heads for it")
    fused = get_module(block, qkv[0])
    rows = slice(fused.weight.shape[0] - kv_heads * d, None)
    return fused.weight[rows], None if fused.bias is None else fused.bias[rows]


def fold_block(block: nn.Module, arch: ArchSpec, residual: torch.Tensor, head: torch.Tensor | None = None) -> None:
    """Fold the residual rotation (and the head rotation, if given) into one decoder block, in place (``arch``: its
    layer's spec, ``ArchSpec.for_layer``): the two block norms are absorbed into the linears that read them and set
    to multiply by one. Per-head q/k norms (Qwen3, Qwen3.5) act after the projections and stay as they are."""
    check_foldable(block, arch)
    refusal = None if head is None else head_rotation_refusal(arch)
    if refusal is not None:
        raise QuantkitError(f"cannot rotate attention heads: {refusal}; rotate the residual stream only")
    with torch.no_grad():
        for norm_path, readers in _norm_readers(arch):
            norm = get_module(block, norm_path)
            scale = norm_scale(norm.weight, arch.norm_offset)
            for path in readers:
                linear = get_module(block, path)
                linear.weight.copy_(rotate_rows(linear.weight, residual, scale=scale))
            norm.weight.fill_(unit_weight(arch.norm_offset))
        for path in _residual_writers(arch):
            linear = get_module(block, path)
            linear.weight.copy_(rotate_rows(linear.weight.T, residual).T)
            if linear.bias is not None:
                linear.bias.copy_(rotate_rows(linear.bias[None, :], residual)[0])
        if head is not None:
            _rotate_heads(block, arch, head)
