"""logit_bias (OpenAI) and min_tokens (vLLM) on hand-made logits: what each adds or masks, and that a request asking
for neither costs nothing (the same tensor back)."""

from __future__ import annotations

import torch

from quantkit.runtime.logits_processors import process_logits
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.sequence import Sequence

NEG = float("-inf")


def _seq(generated: int = 0, **params) -> Sequence:
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=10, **params))
    seq.token_ids += [7] * generated
    return seq


def test_nothing_asked_returns_the_same_tensor() -> None:
    logits = torch.zeros(2, 6)
    assert process_logits(logits, [_seq(), _seq(3)], {0}) is logits


def test_logit_bias_is_added_per_row_and_the_input_is_left_alone() -> None:
    logits = torch.zeros(2, 6)
    out = process_logits(logits, [_seq(logit_bias={1: 2.5, 4: -100}), _seq(logit_bias={5: 100})], {0})
    assert out[0].tolist() == [0, 2.5, 0, 0, -100, 0] and out[1].tolist() == [0, 0, 0, 0, 0, 100]
    assert torch.equal(logits, torch.zeros(2, 6))


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached() -> None:
    logits = torch.zeros(3, 6)
    seqs = [
        _seq(1, min_tokens=2, stop_token_ids=[3]),  # 1 < 2: EOS 0 and stop id 3 masked
        _seq(2, min_tokens=2, stop_token_ids=[3]),  # reached: nothing masked
        _seq(0, min_tokens=2, ignore_eos=True, stop_token_ids=[4]),  # EOS does not stop it anyway: only 4
    ]
    out = process_logits(logits, seqs, {0})
    assert out[0].tolist() == [NEG, 0, 0, NEG, 0, 0]
    assert out[1].tolist() == [0] * 6
    assert out[2].tolist() == [0, 0, 0, 0, NEG, 0]


def test_min_tokens_mask_wins_over_a_positive_bias() -> None:
    out = process_logits(torch.zeros(1, 4), [_seq(0, min_tokens=1, logit_bias={0: 100})], {0})
    assert out[0, 0] == NEG
