"""The engine on the GPU against references, by logits: ``engines`` (the Triton backend against the torch backend on
one quantized checkpoint, after the kernel self-check) and ``parity`` (the engine against HF transformers on a float
model).

Both compare teacher-forced logits: every engine is driven along the same tokens (the reference's greedy
continuation), so each decode step's logits are compared at the same context even where greedy decoding would part
at a near tie. Figures: the largest absolute logit error, the relative error (max |a - b| / max |b| per position,
the worst position), how often the argmax agrees, and how many free-running greedy continuations are identical
(a divergence is reported with the reference's top-2 margin at that position: a near tie flips under any change of
summation order).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import torch

from tools.gpu_check_common import device_name, write

NEAR_TIE = 0.1  # logits: a greedy flip at a smaller top-2 margin is within low-precision rounding


def random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 41, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for length in lengths]


def greedy_run(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from quantkit.runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    return [done[i] for i in ids]


@torch.inference_mode()
def forced_logits(engine, prompts: list[list[int]], continuations: list[list[int]]) -> list[torch.Tensor]:
    """fp32 logits ``[len(continuation), vocab]`` per prompt: row j is what the engine predicts for token j of the
    continuation, which is then appended whatever the engine would have sampled (its scheduler and runner, driven
    as ``Engine.step`` drives them, minus sampling)."""
    from quantkit.runtime.sampling_params import SamplingParams

    index = {tuple(p): i for i, p in enumerate(prompts)}
    assert len(index) == len(prompts), "the prompts must differ"
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for p, c in zip(prompts, continuations, strict=True):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=len(c), ignore_eos=True))
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        if not out.seqs:
            continue
        logits = engine.runner.forward(out, engine.runner.prepare(out))
        forced = []
        for row, seq in enumerate(out.seqs):
            i = index[tuple(seq.prompt_token_ids)]
            rows[i].append(logits[row].float().cpu())
            forced.append(continuations[i][len(rows[i]) - 1])
        engine.scheduler.postprocess(out.seqs, forced)
    return [torch.stack(r) for r in rows]


def compare_logits(test: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    a, b = torch.cat(test), torch.cat(ref)
    diff = (a - b).abs()
    rel = diff.amax(dim=-1) / b.abs().amax(dim=-1).clamp_min(1e-6)
    return {
        "positions": int(b.shape[0]),
        "logits_max_abs_err": float(diff.max()),
        "logits_rel_err": float(rel.max()),
        "logits_rel_err_median": float(rel.median()),
        "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
        "finite": bool(torch.isfinite(a).all()),
    }


def divergences(test: list[list[int]], ref: list[list[int]], ref_logits: list[torch.Tensor]) -> list[dict]:
    found = []
    for i, (mine, theirs) in enumerate(zip(test, ref, strict=True)):
        at = next((j for j, (x, y) in enumerate(zip(mine, theirs, strict=False)) if x != y), None)
        if at is None:
            continue
        top2 = ref_logits[i][at].topk(2).values
        margin = float(top2[0] - top2[1])
        found.append({"prompt": i, "position": at, "test": mine[at], "ref": theirs[at], "ref_margin": margin})
    return found


def _engine(checkpoint: Path, backend: str, dtype: str, prompts: int, longest: int):
    from quantkit.runtime.engine import Engine

    device = device_name()
    return Engine(checkpoint, backend=backend, dtype=dtype, device=device, max_num_seqs=prompts, max_model_len=longest)


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engines(checkpoint: Path, out: Path, dtype: str, prompts: int, tokens: int) -> None:
    """The kernel self-check, the backend ``auto`` picks, then the Triton engine against the torch engine."""
    from quantkit.runtime.attention_backend import select_backend
    from quantkit.runtime.kernels.backend import triton_available
    from quantkit.runtime.kernels.selfcheck import check_kernels
    from quantkit.runtime.layers import Linear, RMSNorm

    device = torch.device(device_name())
    start = time.perf_counter()
    check = check_kernels(device) if triton_available() else None
    check_s = time.perf_counter() - start
    if check is None:
        verdict = "no triton"
    else:
        verdict = "all pass" if check.usable else "FAILED: " + ", ".join(c.kernel for c in check.failed)
    figures: dict = {"selfcheck": verdict, "selfcheck_s": round(check_s, 1)}
    figures["auto_backend"] = select_backend("auto", device).name
    data: dict = {"selfcheck": None if check is None else [asdict(c) for c in check.checks]}
    write(out, data | {"figures": figures})
    reference = _engine(checkpoint, "torch", dtype, prompts, 40 + tokens + 8)
    cases = random_prompts(prompts, reference.model.config.vocab_size)
    ref_tokens = greedy_run(reference, cases, tokens)
    ref_logits = forced_logits(reference, cases, ref_tokens)
    del reference
    _empty_cache()
    start = time.perf_counter()
    try:
        engine = _engine(checkpoint, "triton", dtype, prompts, 40 + tokens + 8)
        mine = greedy_run(engine, cases, tokens)
        figures["triton_engine_first_run_s"] = round(time.perf_counter() - start, 1)  # load, compile, generate
        logits = forced_logits(engine, cases, ref_tokens)
    except Exception as exc:  # recorded as a figure (the traceback goes to the log), then the step fails
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        figures["triton_engine"] = f"FAILED: {type(exc).__name__}: {first}"
        write(out, data | {"figures": figures})
        raise
    modules = list(engine.model.modules())
    figures["packed_linears"] = sum(isinstance(m, Linear) and m.use_kernel for m in modules)
    figures["kernel_norms"] = sum(isinstance(m, RMSNorm) and m.use_kernel for m in modules)
    figures |= compare_logits(logits, ref_logits)
    found = divergences(mine, ref_tokens, ref_logits)
    figures["greedy_identical"] = f"{len(cases) - len(found)}/{len(cases)}"
    figures["unexplained_divergences"] = sum(d["ref_margin"] >= NEAR_TIE for d in found)
    write(out, data | {"figures": figures, "dtype": dtype, "tokens": tokens, "divergences": found})


def parity(model: Path, out: Path, prompts: int, tokens: int, dtype: str) -> None:
    """The engine (the Triton backend on CUDA) against HF transformers' eager model, both in ``dtype``."""
    from transformers import AutoModelForCausalLM

    device = device_name()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    cases = random_prompts(prompts, hf.config.vocab_size, seed=1)
    ref_tokens, ref_logits = [], []
    with torch.inference_mode():
        for prompt in cases:
            ids = torch.tensor([prompt], device=device)
            gen = hf.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
            ref_tokens.append(gen[0, len(prompt) :].tolist())
            full = hf(gen).logits[0, len(prompt) - 1 : len(prompt) + tokens - 1].float().cpu()
            ref_logits.append(full)
    del hf
    _empty_cache()
    backend = "triton" if device == "cuda" else "torch"
    engine = _engine(model, backend, dtype, prompts, 40 + tokens + 8)
    mine = greedy_run(engine, cases, tokens)
    logits = forced_logits(engine, cases, ref_tokens)
    found = divergences(mine, ref_tokens, ref_logits)
    figures = {"backend": backend, "dtype": dtype} | compare_logits(logits, ref_logits)
    figures["greedy_identical"] = f"{len(cases) - len(found)}/{len(cases)}"
    figures["unexplained_divergences"] = sum(d["ref_margin"] >= NEAR_TIE for d in found)
    write(out, {"figures": figures, "tokens": tokens, "near_tie": NEAR_TIE, "divergences": found})
