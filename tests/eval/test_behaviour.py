"""Behaviour checks (quantkit/eval/behaviour.py): each figure on crafted token sequences, then on tiny models whose
replies are known by construction (one that stops at once, one that repeats one token, a copy, a perturbed head),
through `quantkit eval --behaviour --json`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.chat_models import EOS, PROBE, THINK_TEMPLATE, emit_only, perturb_head, save_chat_model
from helpers.cli import run_cli
from helpers.threads import torch_threads
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantkit.errors import QuantkitError
from quantkit.eval.behaviour import (
    BehaviourConfig,
    Reply,
    measure_behaviour,
    position_agreement,
    reasoning_tags,
    repetition_share,
    stop_token_ids,
    tag_state,
)
from quantkit.eval.evaluate import EvalConfig, evaluate

FEW = ["--behaviour-prompts", "4", "--max-new-tokens", "12"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("behaviour")
    return {
        "chat": save_chat_model(root / "chat"),
        "copy": save_chat_model(root / "copy"),  # the same weights in another directory: generated again, not reused
        "perturbed": save_chat_model(root / "perturbed", edit=perturb_head),
        "stops": save_chat_model(root / "stops", edit=emit_only(EOS)),
        "repeats": save_chat_model(root / "repeats", edit=emit_only(PROBE)),
        "thinks": save_chat_model(root / "thinks", THINK_TEMPLATE, edit=emit_only(PROBE)),
    }


def _behaviour(candidate: Path, reference: Path, tmp_path: Path, capsys, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "eval.json"
    text = tmp_path / "text.txt"
    text.write_text("the a of and to in was her she he it that " * 20)
    args = ["eval", str(candidate), "--reference", str(reference), "--behaviour", *FEW, *extra]
    code, printed, err = run_cli(
        [*args, "--dataset", str(text), "--seq-len", "32", "--max-windows", "1", "--json", str(out)], capsys
    )
    assert code == 0, err
    return json.loads(out.read_text()), " ".join(printed.split())


# --- the figures on crafted sequences ---------------------------------------------------------------------------


def test_repetition_counts_4_grams_that_repeat_an_earlier_one() -> None:
    assert repetition_share([1, 2, 3, 4, 5, 6, 7]) == 0.0
    assert repetition_share([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 / 5)  # 1234 2341 3412 4123 1234
    assert repetition_share([9] * 10) == pytest.approx(6 / 7)
    assert repetition_share([9, 9, 9]) == 0.0  # no 4-gram at all


def test_agreement_compares_positions_and_counts_the_stop() -> None:
    reply = Reply([5, 6, 7], True, "")
    assert position_agreement(reply, reply) == 1.0
    assert position_agreement(reply, Reply([5, 6, 8], True, "")) == pytest.approx(3 / 4)  # 5 6 . END
    assert position_agreement(reply, Reply([5, 6, 7, 8, 9], False, "")) == pytest.approx(3 / 5)  # ends vs goes on
    long = Reply(list(range(40)), False, "")
    assert position_agreement(long, Reply(list(range(16)) + [0] * 24, False, "")) == pytest.approx(16 / 32)


def test_a_reasoning_block_is_open_until_its_closer() -> None:
    tags = ("<think>", "</think>")
    assert tag_state("user: hi\nassistant:", "plain answer", tags) == (False, False)
    assert tag_state("user: hi\nassistant:", "<think> hmm </think> answer", tags) == (True, True)
    assert tag_state("user: hi\nassistant:", "<think> hmm and hmm", tags) == (True, False)
    assert tag_state("assistant: <think>", "hmm </think> answer", tags) == (True, True)  # the prompt opened it
    assert tag_state("<think> a </think> assistant:", "no tag", tags) == (False, False)  # closed before the reply


def test_tags_and_stop_tokens_come_from_the_template_the_vocabulary_and_the_configs(models) -> None:
    plain = AutoTokenizer.from_pretrained(models["chat"])
    assert reasoning_tags(plain) is None
    assert reasoning_tags(AutoTokenizer.from_pretrained(models["thinks"])) == ("<think>", "</think>")
    model = AutoModelForCausalLM.from_pretrained(models["chat"])
    model.generation_config.eos_token_id = [EOS, 7]
    assert stop_token_ids(plain, model) == [EOS, 7]


# --- on models whose replies are known ----------------------------------------------------------------------------


def test_a_copy_of_the_reference_agrees_fully_with_zero_differences(models, tmp_path, capsys) -> None:
    result, printed = _behaviour(models["copy"], models["chat"], tmp_path, capsys)
    behaviour = result["behaviour"]
    assert behaviour["prompts"] == 4 and behaviour["max_new_tokens"] == 12 and behaviour["reasoning_tags"] is None
    assert behaviour["first32_agreement"] == 1.0 and behaviour["first32_agreement_se"] == 0.0
    assert behaviour["difference"] == {
        "end_rate": 0.0,
        "repetition": 0.0,
        "mean_reply_tokens": 0.0,
        "tag_close_rate": None,
    }
    assert behaviour["candidate"]["replies"] == behaviour["reference"]["replies"]
    assert len(behaviour["candidate"]["replies"]) == 4
    assert result["perplexity"] > 1.0  # the perplexity evaluation ran as well
    assert "Behaviour: greedy replies to 4 shipped chat prompts (at most 12 new tokens)" in printed
    assert "│ first-32-token agreement │ - │ 1.000 ± 0.000 │" in printed


def test_a_perturbed_head_disagrees(models) -> None:
    result = _measure(models["perturbed"], models["chat"])
    assert result.first32_agreement < 0.9
    assert result.candidate.replies != result.reference.replies


def test_a_model_that_stops_at_once_ends_every_reply(models) -> None:
    result = _measure(models["stops"], models["repeats"])
    assert result.candidate.end_rate == 1.0 and result.candidate.mean_reply_tokens == 0
    assert result.candidate.repetition == 0.0
    # the reference never stops and repeats one token: 9 4-grams in 12 tokens, 8 repeats
    assert result.reference.end_rate == 0.0 and result.reference.mean_reply_tokens == 12
    assert result.reference.repetition == pytest.approx(8 / 9)
    assert result.difference()["repetition"] == pytest.approx(-8 / 9)
    assert result.first32_agreement == pytest.approx(0.0)  # the stop against the probe token at position 0, ...


def test_a_template_that_opens_a_think_block_is_checked_for_its_closer(models) -> None:
    result = _measure(models["thinks"], models["thinks"])
    assert result.reasoning_tags == ["<think>", "</think>"]
    assert result.candidate.tag_open_rate == 1.0 and result.candidate.tag_close_rate == 0.0
    assert result.candidate.end_rate == 0.0


def _measure(candidate: Path, reference: Path):
    from quantkit.model.resolve import load_model, load_tokenizer

    config = BehaviourConfig(prompts=4, max_new_tokens=12, show_progress=False)
    return measure_behaviour(load_model(candidate), load_tokenizer(candidate), load_model(reference), config)


# --- refusals -----------------------------------------------------------------------------------------------------


def test_a_tokenizer_without_a_chat_template_is_refused_in_one_line(tiny_model_dir, capsys) -> None:
    code, _, err = run_cli(["eval", str(tiny_model_dir), "--reference", str(tiny_model_dir), "--behaviour"], capsys)
    assert code == 2
    message = " ".join(err.split())
    assert "has no chat template" in message and "add a chat_template" in message
    assert "Traceback" not in err


def test_behaviour_needs_a_reference_and_its_options_need_the_switch(models, capsys) -> None:
    with pytest.raises(QuantkitError, match="add --reference"):
        evaluate(models["chat"], EvalConfig(behaviour=BehaviourConfig()))
    code, _, err = run_cli(["eval", str(models["chat"]), "--max-new-tokens", "8"], capsys)
    assert code == 2 and "add --behaviour" in err
    with pytest.raises(QuantkitError, match="between 1 and 32"):
        BehaviourConfig(prompts=33).validate()


@pytest.mark.e2e
def test_the_default_model_answers_in_its_chat_template_and_ends_its_short_replies(smollm2_dir) -> None:
    from quantkit.eval.behaviour import render_prompts, shipped_prompts
    from quantkit.model.resolve import load_model, load_tokenizer

    tokenizer, model = load_tokenizer(smollm2_dir), load_model(smollm2_dir)
    (rendered,) = render_prompts(tokenizer, shipped_prompts(1), "smollm2")
    assert rendered.endswith("<|im_start|>assistant\n") and shipped_prompts(1)[0] in rendered
    assert stop_token_ids(tokenizer, model) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    config = BehaviourConfig(prompts=2, max_new_tokens=64, show_progress=False)
    with torch_threads(1):  # decoding one token at a time stalls on a second thread when the CPU is shared
        result = measure_behaviour(model, tokenizer, model, config)
    assert result.reasoning_tags is None and result.candidate.tag_close_rate is None
    # the summary and the speaker question get one-sentence answers inside the limit (measured: 29 and 42 tokens)
    assert result.candidate.end_rate >= 0.5 and result.first32_agreement == 1.0
    assert all(reply.strip() for reply in result.candidate.replies)
