import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from quantkit.data.sources import DEFAULT_CALIBRATION, load_documents, parse_hub_spec
from quantkit.errors import CalibrationError


def test_each_local_format_reads_its_documents(tmp_path):
    (tmp_path / "a.txt").write_text("plain text document")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    (tmp_path / "c.json").write_text(json.dumps([{"text": "three"}, "four"]))
    pq.write_table(pa.table({"text": ["five", "six"]}), tmp_path / "d.parquet")
    assert load_documents(tmp_path / "a.txt").texts == ["plain text document"]
    assert load_documents(tmp_path / "b.jsonl").texts == ["one", "two"]
    assert load_documents(tmp_path / "c.json").texts == ["three", "four"]
    assert load_documents(tmp_path / "d.parquet").texts == ["five", "six"]
    every = load_documents(tmp_path)
    assert every.texts == ["plain text document", "one", "two", "three", "four", "five", "six"]


def test_messages_are_rendered_with_the_chat_renderer(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    docs = load_documents(path, render_chat=lambda msgs: "|".join(m["content"] for m in msgs) + "!")
    assert docs.texts == ["hi!"]
    with pytest.raises(CalibrationError, match="chat template"):
        load_documents(path)


def test_text_column_and_hash(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"body": "alpha"}) + "\n")
    with pytest.raises(CalibrationError, match="--text-column"):
        load_documents(path)
    first = load_documents(path, text_column="body")
    assert first.texts == ["alpha"]
    path.write_text(json.dumps({"body": "alpha!"}) + "\n")
    assert load_documents(path, text_column="body").content_hash != first.content_hash


def test_bad_inputs_have_clear_messages(tmp_path):
    with pytest.raises(CalibrationError, match="not found"):
        load_documents(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(CalibrationError, match="no text"):
        load_documents(tmp_path / "empty.txt")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(CalibrationError, match=r"bad.jsonl:2: invalid JSON"):
        load_documents(tmp_path / "bad.jsonl")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(CalibrationError, match="unsupported format"):
        load_documents(tmp_path / "x.csv")


def test_hub_spec_parsing():
    assert parse_hub_spec("wikitext:wikitext-2-raw-v1:test") == ("wikitext", "wikitext-2-raw-v1", "test")
    assert parse_hub_spec("org/data") == ("org/data", None, "train")
    for bad in ("a:b:c:d", "a::b", ":x"):
        with pytest.raises(CalibrationError, match="bad dataset id"):
            parse_hub_spec(bad)


def test_offline_hub_dataset_fails_with_a_way_out():
    with pytest.raises(CalibrationError, match=r"local \.txt"):
        load_documents("quantkit-test-org/no-such-dataset")


def test_default_source_is_the_shipped_corpus():
    docs = load_documents(None)
    assert docs.source == f"shipped:{DEFAULT_CALIBRATION.name}"
    assert len(docs) == 245  # chapters of five novels
