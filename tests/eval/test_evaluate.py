import json
import math

import pytest
import torch

from quantkit.atomic import write_json
from quantkit.errors import QuantkitError
from quantkit.eval.evaluate import EvalConfig, evaluate, make_windows, score_windows
from quantkit.eval.logit_metrics import token_kl


def test_uniform_logits_give_perplexity_equal_to_vocab_size():
    vocab = 37
    windows = make_windows([i % vocab for i in range(100)], seq_len=10, stride=10, prefix=[], max_windows=None)
    metrics = score_windows(lambda ids: torch.zeros(*ids.shape, vocab), windows, show_progress=False)
    assert metrics.perplexity == pytest.approx(vocab, rel=1e-6)  # float32 log-softmax


def test_known_next_token_probability_gives_its_inverse():
    # The model puts probability p on the true next token (stream = 0, 1, 2, ...), the rest spread evenly.
    vocab, p = 16, 0.5

    def logits_fn(ids):
        logits = torch.full((*ids.shape, vocab), math.log((1 - p) / (vocab - 1)))
        logits.scatter_(-1, ((ids + 1) % vocab).unsqueeze(-1), math.log(p))
        return logits

    windows = make_windows([i % vocab for i in range(200)], 20, 20, [], None)
    assert score_windows(logits_fn, windows, show_progress=False).perplexity == pytest.approx(1 / p, rel=1e-6)


def test_windows_score_every_token_once():
    stream = list(range(1000))
    plain = make_windows(stream, 100, 100, [], None)
    assert len(plain) == 10
    assert sum(len(w.input_ids) - w.first_scored for w in plain) == 10 * 99  # first token lacks context
    with_bos = make_windows(stream, 101, 100, [7], None)
    assert sum(len(w.input_ids) - w.first_scored for w in with_bos) == 1000
    sliding = make_windows(stream, 100, 25, [], None)
    assert sum(len(w.input_ids) - w.first_scored for w in sliding) == 999  # every token after the first
    assert len(make_windows(stream, 100, 100, [], 3)) == 3
    with pytest.raises(QuantkitError, match="fewer than one window"):
        make_windows(stream[:50], 100, 100, [], None)


def test_kl_matches_a_direct_computation():
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.5, 0.25, 0.25])
    expected = float((p * (p / q).log()).sum())
    assert float(token_kl(p.log(), q.log())) == pytest.approx(expected, rel=1e-6)
    assert float(token_kl(p.log(), p.log())) == pytest.approx(0.0, abs=1e-7)


def test_model_is_its_own_reference(tiny_model_dir, text_corpus, tmp_path):
    out = tmp_path / "eval.json"
    config = EvalConfig(
        dataset=str(text_corpus), seq_len=32, max_windows=5, reference=str(tiny_model_dir), show_progress=False
    )
    result = evaluate(tiny_model_dir, config)
    assert result.windows == 5 and result.tokens == 5 * 31
    assert result.kl_mean == pytest.approx(0.0, abs=1e-6)
    assert result.top1_agreement == 1.0
    write_json(out, result.to_dict())
    data = json.loads(out.read_text())
    for key in ("perplexity", "tokens", "windows", "kl_mean", "kl_p99", "top1_agreement"):
        assert key in data
    assert 1.0 < data["perplexity"] < 1e4


def test_a_different_reference_has_positive_kl(tiny_model_dir, tmp_path, text_corpus):
    from helpers.tiny import save_tiny_model

    other = save_tiny_model(tmp_path / "other", seed=5)
    config = EvalConfig(dataset=str(text_corpus), seq_len=32, max_windows=3, reference=str(other), show_progress=False)
    result = evaluate(tiny_model_dir, config)
    assert result.kl_mean > 1e-3 and result.top1_agreement < 1.0
