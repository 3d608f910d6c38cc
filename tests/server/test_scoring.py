"""/v1/completions scoring (``logprobs``, ``echo``, ``max_tokens: 0``) as the OpenAI legacy completions API shapes
it, with values equal to the float model's log-softmax; the served model name; ``created`` stamps; no local path
in any message a client sees."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from helpers.tiny import save_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantkit.runtime.config import EngineConfig
from quantkit.runtime.engine import Engine
from quantkit.server import ServeConfig, ServerThread, create_app
from quantkit.server.app import default_served_name
from quantkit.server.protocol import MAX_LOGPROBS

MODEL = "tiny"
TOL = 1e-4
PROMPT = "she was not the first of the family to say so"
ALIGNED = {"tokens", "token_logprobs", "top_logprobs", "text_offset"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("scoring") / "model", max_position_embeddings=256)


@pytest.fixture(scope="module")
def srv(model_dir):
    config = ServeConfig(port=0, served_model_name=MODEL, engine=EngineConfig(num_kv_blocks=128))
    with ServerThread(create_app(model_dir, config)) as server:
        yield server


@pytest.fixture(scope="module")
def api(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def _log_softmax(hf, ids: list[int]) -> torch.Tensor:
    """Row p scores token p + 1."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _greedy(hf, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(_log_softmax(hf, ids)[-1].argmax()))
    return ids


def _check_values(lp, ids: list[int], start: int, ref: torch.Tensor, tok, k: int, as_ids: bool = False) -> None:
    """``lp`` scores ``ids[start:]``; the first token of a prompt (start 0) has no score."""
    decode = (lambda i: f"token_id:{i}") if as_ids else (lambda i: tok.decode([i]))
    pieces = [decode(i) for i in ids[start:]]
    assert lp.tokens == pieces
    assert lp.text_offset == [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    for j, token_id in enumerate(ids[start:], start=start):
        value, top = lp.token_logprobs[j - start], lp.top_logprobs[j - start]
        if j == 0:
            assert value is None and top is None
            continue
        row = ref[j - 1]
        assert abs(value - row[token_id].item()) < TOL, j
        expected = {decode(token_id): row[token_id].item()}
        for i in row.topk(k).indices.tolist():
            expected.setdefault(decode(i), row[i].item())
        assert top.keys() == expected.keys()
        assert all(abs(top[key] - expected[key]) < TOL for key in expected)


# ----------------------------------------------------------------- echo and logprobs
@pytest.mark.parametrize("as_ids", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt(api, hf, tok, as_ids):
    ids = tok(PROMPT).input_ids
    done = api.completions.create(
        model=MODEL, prompt=ids if as_ids else PROMPT, echo=True, max_tokens=0, logprobs=3, temperature=0
    )
    choice = done.choices[0]
    assert choice.text == tok.decode(ids) if as_ids else choice.text == PROMPT
    assert choice.finish_reason == "length"
    assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(ids)
    _check_values(choice.logprobs, ids, 0, _log_softmax(hf, ids), tok, 3)


def test_the_json_is_openais_legacy_logprobs_object(srv):
    body = {"model": MODEL, "prompt": "the family", "echo": True, "max_tokens": 1, "logprobs": 0, "temperature": 0}
    choice = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
    lp = choice["logprobs"]
    assert set(lp) == ALIGNED and all(len(lp[key]) == 3 for key in ALIGNED)  # two prompt tokens and one generated
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert [len(top) for top in lp["top_logprobs"][1:]] == [1, 1]  # logprobs 0: the token itself only
    assert choice["text"].startswith("the family")


def test_generated_tokens_carry_logprobs_streamed_or_not(api, hf, tok):
    ids = tok("the family was").input_ids
    full = _greedy(hf, ids, 6)
    ref = _log_softmax(hf, full)
    kwargs = {"model": MODEL, "prompt": ids, "max_tokens": 6, "logprobs": 2, "temperature": 0}
    kwargs["extra_body"] = {"ignore_eos": True}
    done = api.completions.create(**kwargs)
    lp = done.choices[0].logprobs
    _check_values(lp, full, len(ids), ref, tok, 2)
    chunks = [c for c in api.completions.create(stream=True, **kwargs) if c.choices]
    streamed = {key: [x for c in chunks if c.choices[0].logprobs for x in getattr(c.choices[0].logprobs, key)]
                for key in ALIGNED}  # fmt: skip
    assert streamed == {key: getattr(lp, key) for key in ALIGNED}
    assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text


def test_echo_streamed_sends_the_scored_prompt_first(api, hf, tok):
    ids = tok(PROMPT).input_ids
    kwargs = {"model": MODEL, "prompt": PROMPT, "echo": True, "max_tokens": 2, "logprobs": 1, "temperature": 0}
    done = api.completions.create(**kwargs)
    chunks = [c for c in api.completions.create(stream=True, **kwargs) if c.choices]
    assert chunks[0].choices[0].text == PROMPT and len(chunks[0].choices[0].logprobs.tokens) == len(ids)
    assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert tokens == done.choices[0].logprobs.token_logprobs and len(tokens) == len(ids) + 2
    full = ids + _greedy(hf, ids, 2)[len(ids) :]
    _check_values(done.choices[0].logprobs, full, 0, _log_softmax(hf, full), tok, 1)


def test_logprobs_are_of_the_raw_distribution_even_when_sampling(api, hf, tok):
    """temperature/top_k change which token is drawn, never the reported log-probability."""
    ids = tok("she was").input_ids
    kwargs = {"model": MODEL, "prompt": ids, "max_tokens": 4, "logprobs": 1, "temperature": 1.8, "top_p": 0.9}
    done = api.completions.create(seed=5, echo=True, extra_body={"return_tokens_as_token_ids": True}, **kwargs)
    lp = done.choices[0].logprobs
    assert all(t.startswith("token_id:") for t in lp.tokens)
    full = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    assert full[: len(ids)] == ids
    _check_values(lp, full, 0, _log_softmax(hf, full), tok, 1, as_ids=True)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"echo": "yes"}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),  # nothing to return without echo
        ({"max_tokens": -1}, "max_tokens"),
        ({"suffix": "x"}, "suffix"),
    ],
)
def test_bad_scoring_requests_get_400(srv, body, param):
    resp = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "the", **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_chat_refuses_logprobs_and_the_schema_documents_the_range(srv):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    resp = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "logprobs"
    schema = httpx.get(f"{srv.url}/openapi.json").json()["components"]["schemas"]
    logprobs = schema["CompletionRequest"]["properties"]["logprobs"]
    integer = next(o for o in logprobs["anyOf"] if o.get("type") == "integer")
    assert (integer["minimum"], integer["maximum"]) == (0, MAX_LOGPROBS)
    assert "before temperature" in integer.get("description", logprobs.get("description", ""))
    assert schema["CompletionRequest"]["properties"]["echo"]["type"] == "boolean"
    assert set(schema["CompletionLogprobs"]["properties"]) == ALIGNED


# ----------------------------------------------------------------- created
def test_created_is_unix_seconds_everywhere(srv, api):
    now = time.time()
    models = httpx.get(f"{srv.url}/v1/models").json()["data"]
    assert all(now - 600 < m["created"] <= now + 1 for m in models)
    messages = [{"role": "user", "content": "hi"}]
    done = api.completions.create(model=MODEL, prompt="the", max_tokens=2)
    chat = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    chunks = list(api.completions.create(model=MODEL, prompt="the", max_tokens=2, stream=True))
    chat_chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True))
    stamps = [done.created, chat.created, *(c.created for c in chunks), *(c.created for c in chat_chunks)]
    assert all(isinstance(s, int) and now - 5 <= s <= time.time() + 1 for s in stamps)
    assert len({c.created for c in chunks}) == 1 and len({c.created for c in chat_chunks}) == 1


# ----------------------------------------------------------------- served model name
def test_default_served_name_is_never_a_path(model_dir, tmp_path, monkeypatch):
    assert default_served_name("smollm2-135m") == "smollm2-135m"  # an alias, as given
    assert default_served_name("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"  # a hub id
    assert default_served_name(model_dir) == "model" == default_served_name(str(model_dir) + "/")
    monkeypatch.chdir(model_dir.parent)
    assert default_served_name("./model") == "model" == default_served_name("model")
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    assert default_served_name(snapshot) == "org/name"
    monkeypatch.setenv("HOME", str(model_dir.parent))
    assert default_served_name("~/model") == "model"


def test_served_name_default_and_override(model_dir):
    app = create_app(model_dir, ServeConfig(port=0, engine=EngineConfig(num_kv_blocks=32)))
    with ServerThread(app) as server:
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["model"]
        body = {"model": "model", "prompt": "the", "max_tokens": 1}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["model"] == "model"
    engine = Engine(model_dir, num_kv_blocks=32)
    assert create_app(engine).state.server.model_name == "model"  # from an engine: its directory's name
    app = create_app(engine, ServeConfig(port=0, served_model_name="my-model"))
    with ServerThread(app) as server:
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == ["my-model"]
        done = httpx.post(f"{server.url}/v1/completions", json={**body, "model": "my-model"}, timeout=60).json()
        assert done["model"] == "my-model"
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'vllm:num_requests_running{model_name="my-model"}' in metrics
        wrong = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "model_not_found"
        assert "my-model" in wrong.json()["error"]["message"]
        spec = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
        assert spec["properties"]["model"]["enum"] == ["my-model"]


def test_an_empty_served_name_is_refused():
    from quantkit.errors import QuantkitError

    with pytest.raises(QuantkitError, match="served_model_name"):
        ServeConfig(served_model_name=" ")


# ----------------------------------------------------------------- no local path reaches a client
def test_no_local_path_in_error_messages(tmp_path, monkeypatch):
    """A model without a tokenizer, served from a relative and from an absolute path: the engine's messages name
    its directory, the client sees <path>."""
    from helpers.tiny import tiny_llama

    secret = tmp_path / "secret-dir" / "weights"
    tiny_llama().save_pretrained(secret)  # no tokenizer
    monkeypatch.chdir(tmp_path)
    for model in ("secret-dir/weights", str(secret)):
        app = create_app(model, ServeConfig(port=0, engine=EngineConfig(num_kv_blocks=16)))
        with ServerThread(app) as server:
            assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "weights"
            bodies = [
                {"model": "weights", "prompt": "text needs a tokenizer"},
                {"model": "weights", "prompt": [5, 6], "stop": ["x"]},  # stop strings need one too
            ]
            for body in bodies:
                resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
                message = resp.json()["error"]["message"]
                assert resp.status_code == 400 and "<path>" in message, message
                assert "secret-dir" not in json.dumps(resp.json()) and str(tmp_path) not in message
            chat = {"model": "weights", "messages": [{"role": "user", "content": "hi"}]}
            resp = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
            assert resp.status_code == 400 and "secret-dir" not in resp.text
    assert os.getcwd() == str(tmp_path)


def test_path_redactor_hides_given_paths_only_as_whole_names(tmp_path, monkeypatch):
    from quantkit.server.protocol import path_redactor

    (tmp_path / "models" / "w4").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    redact = path_redactor(["models/w4", "models/w4/", "w4", "/", "not/here"])
    assert redact("models/w4 has no tokenizer") == "<path> has no tokenizer"
    assert redact(f"{tmp_path}/models/w4 is a file") == "<path> is a file"
    assert (
        redact("models/w42 and old-models/w4 and w4 and not/here") == "models/w42 and old-models/w4 and w4 and not/here"
    )
