"""Detokenizer: whole-completion text, stop strings across token boundaries, and stream deltas."""

from __future__ import annotations

import pytest
from helpers.tiny import build_word_tokenizer

from quantkit.runtime.detokenizer import Detokenized, Detokenizer


@pytest.fixture(scope="module")
def words():
    return build_word_tokenizer()  # decodes words joined by single spaces


@pytest.fixture(scope="module")
def byte_level():
    """One token per UTF-8 byte, so a multi-byte character spans several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core)


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text).input_ids)


def _feed(detok: Detokenizer, ids: list[int], finish: bool = True) -> list[Detokenized]:
    """Token by token, as the engine does while streaming; the last update is marked finished."""
    return [detok.update(ids[:n], finished=finish and n == len(ids)) for n in range(1, len(ids) + 1)]


def test_stop_string_split_across_two_tokens(words) -> None:
    ids = _ids(words, "it was her to")
    assert len(ids) == 4
    detok = Detokenizer(words, ["as he"])  # "w|as" + " " + "he|r"
    steps = _feed(detok, ids[:3], finish=False)
    assert [s.text for s in steps] == ["it", "it was", "it w"]
    assert [s.stopped for s in steps] == [False, False, True]
    assert [s.delta for s in steps] == ["", "it", " w"]  # 4 characters held back (len("as he") - 1)
    assert detok.update(ids, finished=True) == Detokenized("it w", "", True)  # nothing changes after a stop


def test_stop_string_at_the_very_start(words) -> None:
    ids = _ids(words, "it was her")
    assert Detokenizer(words, ["it"]).update(ids[:1]) == Detokenized("", "", True)
    steps = _feed(Detokenizer(words, ["it was"]), ids[:2], finish=False)  # found only once both tokens are in
    assert steps == [Detokenized("it", "", False), Detokenized("", "", True)]


def test_earliest_of_several_stop_strings_wins(words) -> None:
    ids = _ids(words, "she was at her")
    # all found in one update: the cut is at the earliest match, whatever the list order
    assert Detokenizer(words, ["her", "at", "was"]).update(ids) == Detokenized("she ", "she ", True)
    # token by token: "her" and "at her" complete together; "at her" starts earlier
    steps = _feed(Detokenizer(words, ["her", "at her"]), ids, finish=False)
    assert [s.text for s in steps] == ["she", "she was", "she was at", "she was "]
    assert [s.delta for s in steps] == ["", "sh", "e w", "as "]
    assert steps[-1].stopped and not any(s.stopped for s in steps[:-1])


def test_multibyte_character_split_across_tokens(byte_level) -> None:
    ids = _ids(byte_level, "café")
    assert len(ids) == 5  # c a f 0xC3 0xA9
    steps = _feed(Detokenizer(byte_level), ids)
    assert [s.text for s in steps] == ["c", "ca", "caf", "caf\ufffd", "café"]
    assert [s.delta for s in steps] == ["c", "a", "f", "", "é"]  # the half character is never streamed
    # a stop string through that character: found once the character is complete and the stop string is in
    steps = _feed(Detokenizer(byte_level, ["fé "]), _ids(byte_level, "café au lait")[:6], finish=False)
    assert [s.text for s in steps] == ["c", "ca", "caf", "caf\ufffd", "café", "ca"]
    assert [s.delta for s in steps] == ["", "", "c", "", "a", ""]
    assert [s.stopped for s in steps] == [False] * 5 + [True]


def test_stop_string_ending_in_a_character_split_across_tokens(byte_level) -> None:
    steps = _feed(Detokenizer(byte_level, ["é"]), _ids(byte_level, "café au lait"), finish=False)
    assert [s.text for s in steps[:5]] == ["c", "ca", "caf", "caf\ufffd", "caf"]


def test_deltas_concatenate_to_the_final_text(words, byte_level) -> None:
    ids = _ids(words, "she was at her")
    steps = _feed(Detokenizer(words, ["xyz"]), ids)  # never found: the last 2 characters are held until the end
    assert [s.delta for s in steps] == ["s", "he w", "as ", "at her"]
    assert "".join(s.delta for s in steps) == steps[-1].text == "she was at her"
    steps = _feed(Detokenizer(words, ["t h"]), ids)  # found: the held tail before the cut comes out last
    assert [s.delta for s in steps] == ["s", "he w", "as ", "a"]
    assert "".join(s.delta for s in steps) == steps[-1].text == "she was a"
    steps = _feed(Detokenizer(byte_level), _ids(byte_level, "naïve – ok"))
    assert "".join(s.delta for s in steps) == steps[-1].text == "naïve – ok"
    assert all("\ufffd" not in s.delta for s in steps)


def test_without_stop_strings_text_is_the_plain_decode(words) -> None:
    ids = _ids(words, "elinor said to marianne")
    out = Detokenizer(words).update([*ids, 2], finished=True)  # </s> is special: skipped
    assert out == Detokenized("elinor said to marianne", "elinor said to marianne", False)
    assert out.text == words.decode(ids, skip_special_tokens=True)
