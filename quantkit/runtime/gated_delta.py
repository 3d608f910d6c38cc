"""The math of a gated DeltaNet layer (Qwen3.5's ``linear_attention``), as pure functions of one sequence's tensors.

* A causal depthwise conv1d over the mixed q/k/v channels, continued from a conv state: the last ``kernel - 1``
  inputs the sequence has seen (zeros before its first token), followed by SiLU.
* The gated delta rule: per value head a ``[Dk, Dv]`` state ``S`` that every token decays by ``exp(g)``, then
  corrects towards its value along its key with strength ``beta`` (``S += k (beta (v - S^T k))^T``), and reads with its
  query (``o = S^T q``); q and k are L2-normalised and q scaled by ``Dk ** -0.5``, all in float32.

The same rule is computed two ways, as transformers computes it (so that fp32 greedy decoding matches ``generate``):
token by token (:func:`recurrent_rule`, decode) and in chunks of 64 tokens (:func:`chunked_rule`, prefill), where
the updates inside a chunk are solved at once through a unit lower-triangular system and the state is carried from
chunk to chunk. Both start from a given state, so a prefill split into chunks by the scheduler continues exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the chunked form (transformers' and fla's default)


def causal_conv(x: torch.Tensor, state: torch.Tensor | None, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, C, n]`` (channels first) through the depthwise causal conv ``weight [C, K]`` after ``state [B, C, K-1]``
    (None: zeros, a sequence's start), then SiLU. Returns (output ``[B, C, n]``, the new state: the last ``K-1``
    inputs)."""
    channels, kernel = weight.shape
    if state is None:
        state = x.new_zeros(x.shape[0], channels, kernel - 1)
    full = torch.cat((state.to(x.dtype), x), dim=-1).to(weight.dtype)
    out = F.conv1d(full, weight[:, None, :], groups=channels)  # one output per new input
    return F.silu(out).to(x.dtype), full[..., -(kernel - 1) :]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k L2-normalised in float32, q scaled by ``Dk ** -0.5``."""
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    return q * q.shape[-1] ** -0.5, k


def recurrent_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. ``q``/``k [B, n, H, Dk]``, ``v [B, n, H, Dv]``, ``g``/``beta [B, n, H]``, ``state
    [B, H, Dk, Dv]`` (float32). Returns (output ``[B, n, H, Dv]`` in v's dtype, the new float32 state)."""
    q, k = _prepare(q, k)
    vf, g, beta = v.float(), g.float(), beta.float()
    s = state.float()
    out = torch.empty_like(vf)
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        remembered = (s * kt[..., None]).sum(dim=-2)  # S^T k: what the state already predicts for this key
        delta = (vf[:, t] - remembered) * beta[:, t, :, None]
        s = s + kt[..., None] * delta[..., None, :]
        out[:, t] = (s * q[:, t, ..., None]).sum(dim=-2)
    return out.to(v.dtype), s


def chunked_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule for one sequence's ``n`` tokens in chunks of :data:`CHUNK`. ``q``/``k [n, H, Dk]``,
    ``v [n, H, Dv]``, ``g``/``beta [n, H]``, ``state [H, Dk, Dv]`` float32 (None: zeros). Returns (output
    ``[n, H, Dv]`` in v's dtype, the new float32 state)."""
    n, heads, dk = k.shape
    dv = v.shape[-1]
    q, k = _prepare(q, k)
    # heads first: [H, n, D]; the tail padded to whole chunks with zeros (no decay, no write: the state is unchanged)
    pad = (-n) % CHUNK
    q, k, vf = (F.pad(x.float().transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.float().transpose(0, 1), (0, pad)) for x in (g, beta))
    chunks = (n + pad) // CHUNK
    q, k, vf = (x.reshape(heads, chunks, CHUNK, -1) for x in (q, k, vf))
    g, beta = g.reshape(heads, chunks, CHUNK), beta.reshape(heads, chunks, CHUNK)
    k_beta, v_beta = k * beta[..., None], vf * beta[..., None]
    decay = g.cumsum(dim=-1)  # log of the decay from the chunk's start to each position
    future = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(future, float("-inf")).exp()  # decay j -> i, i >= j
    # Within a chunk the writes depend on each other through the state: solving (I + A) X = B with A the strictly
    # lower part of (beta k k^T) * decay gives every position's write at once (the UT transform of DeltaNet's paper)
    system = (k_beta @ k.transpose(-1, -2)) * pair
    writes = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    local = (q @ k.transpose(-1, -2)) * pair  # attention within the chunk, decayed
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    s = q.new_zeros(heads, dk, dv) if state is None else state.float()
    out = torch.empty_like(vf)
    for c in range(chunks):
        correction = writes[:, c] - reads[:, c] @ s  # the writes less what the state carried in already predicts
        out[:, c] = q_decayed[:, c] @ s + local[:, c] @ correction
        s = s * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ correction
    out = out.reshape(heads, chunks * CHUNK, dv)[:, :n].transpose(0, 1)
    return out.to(v.dtype), s


def decay_and_strength(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and value head: the log decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32) and the write
    strength ``beta = sigmoid(b)``, from the ``in_proj_a`` / ``in_proj_b`` projections, as transformers has them."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()
