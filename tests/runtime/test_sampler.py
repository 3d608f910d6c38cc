"""Sampler: greedy, top-k / top-p masks on hand-made distributions, per-request seeded generators."""

from __future__ import annotations

import math

import torch

from quantkit.runtime.sampler import Sampler, apply_top_k, apply_top_p
from quantkit.runtime.sampling_params import SamplingParams

NEG = float("-inf")


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=0.7, top_k=1)] * 3
    assert Sampler()(logits, params, [None] * 6) == logits.argmax(-1).tolist()


def test_top_k_mask() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    out = apply_top_k(logits, torch.tensor([2, -1]))
    assert out[0].tolist() == [NEG, 5.0, NEG, 4.0, NEG]
    assert torch.equal(out[1], logits[1])  # disabled


def test_top_p_mask() -> None:
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15], [0.5, 0.05, 0.3, 0.15], [0.9, 0.04, 0.03, 0.03]])
    out = apply_top_p(probs.log(), torch.tensor([0.8, 0.81, 0.5]))
    keep = out > NEG
    assert keep[0].tolist() == [True, False, True, False]  # 0.5 + 0.3 reaches 0.8
    assert keep[1].tolist() == [True, False, True, True]  # 0.81 needs the 0.15 token too
    assert keep[2].tolist() == [True, False, False, False]  # the top token alone is always kept


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = probs.log()[None].repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    counts = torch.bincount(torch.tensor(Sampler(torch.Generator().manual_seed(0))(logits, params, [None] * 4000)))
    assert counts.shape[0] == 3  # probability 0 is never drawn
    assert torch.allclose(counts.float() / 4000, probs[:3], atol=0.03)


def test_same_seed_same_tokens_different_seed_differs() -> None:
    logits = torch.zeros(1, 1000)  # uniform: any difference in the generator shows
    params = [SamplingParams(temperature=1.0, seed=7)]
    sampler = Sampler(torch.Generator().manual_seed(0))

    def draw(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [sampler(logits, params, [gen])[0] for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_temperature_sharpens() -> None:
    logits = torch.tensor([[math.log(0.6), math.log(0.4)]]).repeat(2000, 1)
    params = [SamplingParams(temperature=0.1)] * 2000
    tokens = Sampler(torch.Generator().manual_seed(1))(logits, params, [None] * 2000)
    assert sum(tokens) / 2000 < 0.05  # (0.4/0.6)**10 ~ 1.7% of draws pick token 1


def test_top_k_beyond_the_vocabulary_keeps_every_token() -> None:
    """Issue #39: top_k 2**63 overflowed the int64 tensor the sampler builds; it now means "keep every token"."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))

    def draw(top_k: int) -> list[int]:
        gens = [torch.Generator().manual_seed(i) for i in range(3)]
        return Sampler()(logits, [SamplingParams(temperature=1.0, top_k=top_k, seed=0)] * 3, gens)

    assert draw(2**63) == draw(2**31) == draw(-1)


def test_temperature_below_the_floor_is_greedy() -> None:
    """1e-300 is 0 in float32: dividing the logits by it gave NaN, and multinomial failed the whole batch."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=t) for t in (1e-300, 1e-6, 9.9e-6, 0.0)]
    assert all(p.greedy for p in params) and not SamplingParams(temperature=1e-5).greedy
    assert Sampler(torch.Generator().manual_seed(0))(logits, params, [None] * 4) == logits.argmax(-1).tolist()


def test_a_row_that_cannot_be_sampled_is_reported_not_raised() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(3))
    logits[1] = float("nan")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.8)]
    tokens, failed = Sampler(torch.Generator().manual_seed(0)).sample(logits, params, [None] * 3)
    assert list(failed) == [1] and tokens[1] == -1
    assert tokens[0] == int(logits[0].argmax()) and 0 <= tokens[2] < 20
