"""lm-evaluation-harness scores a served checkpoint: its own ``local-completions`` model class (the requests it
sends: token-id prompts, ``echo: true``, ``max_tokens: 1``, ``logprobs: 1``; the way it parses the answers) against
`quantkit serve` on a quantized tiny checkpoint, equal to the same checkpoint scored in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.paths import REPO
from helpers.runtime import save_quantized
from helpers.tiny import build_word_tokenizer, tiny_llama
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI  # needs lm-eval's [api] extra (a dev dependency)

from quantkit.format.loader import load_quantized_model
from quantkit.runtime.config import EngineConfig
from quantkit.server import ServeConfig, ServerThread, create_app

pytestmark = pytest.mark.slow

NAME = "tiny-w4"
TOL = 1e-3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tok = build_word_tokenizer()
    model = tiny_llama(seed=1, bos_token_id=1, eos_token_id=2, vocab_size=len(tok))  # every id is a word or char
    path = save_quantized(model, tmp_path_factory.mktemp("lmeval") / "q")
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def url(checkpoint):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    app = create_app(
        checkpoint,
        ServeConfig(port=0, served_model_name=NAME, engine=EngineConfig(max_model_len=128, num_kv_blocks=64)),
    )
    with ServerThread(app) as server:
        yield server.url
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The checkpoint loaded in-process (quantkit's QuantLinear loader): log_softmax of its fp32 logits."""
    model = load_quantized_model(checkpoint, dtype=torch.float32)

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return log_softmax


def _pairs() -> list[tuple[str, str]]:
    words = (REPO / "calibration" / "austen_persuasion_eval.txt").read_text()[:6000].split()
    return [(" ".join(words[i : i + 14]), " " + " ".join(words[i + 14 : i + 19])) for i in (0, 50, 100, 150, 200)]


def _lm(url: str, checkpoint: Path, **kwargs) -> LocalCompletionsAPI:
    return LocalCompletionsAPI(
        model=NAME,
        base_url=f"{url}/v1/completions",
        tokenizer=str(checkpoint),  # a local tokenizer: nothing is fetched
        tokenizer_backend="huggingface",
        max_length=128,
        max_retries=1,
        timeout=60,
        **kwargs,
    )


def _instances(kind: str, args: list[tuple[str, ...]]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.mark.parametrize("num_concurrent", [1, 3])
def test_loglikelihood_matches_the_checkpoint_in_process(url, checkpoint, reference, num_concurrent):
    lm = _lm(url, checkpoint, num_concurrent=num_concurrent)
    pairs = _pairs()
    results = lm.loglikelihood(_instances("loglikelihood", pairs), disable_tqdm=True)
    tok = build_word_tokenizer()
    greedy_seen = set()
    for (context, continuation), (logprob, is_greedy) in zip(pairs, results, strict=True):
        ctx = tok(context, add_special_tokens=False).input_ids
        whole = tok(context + continuation, add_special_tokens=False).input_ids
        rows = reference(whole)[len(ctx) - 1 : -1]
        target = torch.tensor(whole[len(ctx) :])
        expected = rows.gather(-1, target[:, None]).sum().item()
        assert abs(logprob - expected) < TOL, (context, continuation, logprob, expected)
        assert is_greedy == bool((rows.argmax(-1) == target).all())
        greedy_seen.add(is_greedy)
    assert greedy_seen == {False}  # random weights: no 5-word continuation is the greedy one


def test_greedy_continuation_is_reported_greedy(url, checkpoint, reference):
    """A continuation made of the model's own argmax tokens comes back is_greedy=True."""
    tok = build_word_tokenizer()
    found = []
    for context, _ in _pairs():
        ids = tok(context, add_special_tokens=False).input_ids
        for _ in range(3):
            ids.append(int(reference(ids)[-1].argmax()))
        continuation = " " + tok.decode(ids[-3:])
        if tok(context + continuation, add_special_tokens=False).input_ids == ids:  # survives a text round trip
            found.append((context, continuation, ids))
    assert found, "no context of the text has a greedy continuation that is plain words"
    results = _lm(url, checkpoint).loglikelihood(_instances("loglikelihood", [f[:2] for f in found]), True)
    for (_, _, ids), (logprob, is_greedy) in zip(found, results, strict=True):
        expected = reference(ids)[-4:-1].gather(-1, torch.tensor(ids[-3:])[:, None]).sum().item()
        assert is_greedy and abs(logprob - expected) < TOL


def test_loglikelihood_rolling_matches(url, checkpoint, reference):
    """Perplexity-style scoring: every token of a text, conditioned on lm-eval's prefix token (BOS, else EOS)."""
    text = " ".join((REPO / "calibration" / "austen_persuasion_eval.txt").read_text()[:2000].split()[:60])
    [total] = _lm(url, checkpoint).loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]), True)
    tok = build_word_tokenizer()
    ids = [tok.bos_token_id, *tok(text, add_special_tokens=False).input_ids]
    assert len(ids) <= 128
    expected = reference(ids)[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).sum().item()
    assert abs(total - expected) < TOL
