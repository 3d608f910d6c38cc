import json

import pytest
import torch
from safetensors.torch import save_file

from quantkit.data.calibration import CalibrationConfig, CalibrationSet, build_calibration
from quantkit.data.diverse import select_diverse
from quantkit.errors import CalibrationError, QuantkitError


def _config(model, dataset, **kw):
    kw.setdefault("num_samples", 6)
    kw.setdefault("seq_len", 32)
    return str(model), CalibrationConfig(dataset=str(dataset), show_progress=False, **kw)


def test_same_seed_same_windows_other_seed_other_windows(tiny_model_dir, text_corpus):
    a = build_calibration(*_config(tiny_model_dir, text_corpus, seed=1)).calibration
    b = build_calibration(*_config(tiny_model_dir, text_corpus, seed=1)).calibration
    c = build_calibration(*_config(tiny_model_dir, text_corpus, seed=2)).calibration
    assert a.input_ids.shape == (6, 32)
    assert torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.input_ids, c.input_ids)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_every_format_calibrates(tiny_model_dir, text_corpus, tmp_path, suffix):
    import pyarrow as pa
    import pyarrow.parquet as pq

    paragraphs = [p for p in text_corpus.read_text().split("\n\n") if p.strip()]
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    elif suffix == ".json":
        path.write_text(json.dumps([{"text": p} for p in paragraphs]))
    else:
        pq.write_table(pa.table({"text": paragraphs}), path)
    result = build_calibration(*_config(tiny_model_dir, path))
    assert result.calibration.input_ids.shape == (6, 32)
    assert result.documents == len(paragraphs)


def test_metadata_records_provenance_and_changes_with_text(tiny_model_dir, text_corpus):
    meta = build_calibration(*_config(tiny_model_dir, text_corpus)).calibration.metadata
    params = json.loads(meta["params"])
    assert params["seq_len"] == 32 and params["num_samples"] == 6 and params["seed"] == 0
    assert len(meta["tokenizer_hash"]) == 16
    text_corpus.write_text(text_corpus.read_text() + " one more sentence.")
    assert (
        build_calibration(*_config(tiny_model_dir, text_corpus)).calibration.metadata["source_hash"]
        != meta["source_hash"]
    )


def test_bos_is_prepended_when_the_tokenizer_adds_it(tiny_bos_model_dir, tiny_model_dir, text_corpus):
    with_bos = build_calibration(*_config(tiny_bos_model_dir, text_corpus)).calibration
    assert with_bos.input_ids.shape == (6, 32)
    assert bool((with_bos.input_ids[:, 0] == 1).all())
    without = build_calibration(*_config(tiny_model_dir, text_corpus)).calibration
    assert not bool((without.input_ids[:, 0] == 1).all())


def test_document_strategy_and_its_length_check(tiny_model_dir, tmp_path):
    path = tmp_path / "docs.jsonl"
    docs = [" ".join(["the"] * 50), " ".join(["of"] * 10), " ".join(["and"] * 40)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    result = build_calibration(*_config(tiny_model_dir, path, strategy="document", num_samples=2, seq_len=32))
    rows = {tuple(set(r.tolist())) for r in result.calibration.input_ids}
    assert len(rows) == 2  # one window from each long document, never the short one
    with pytest.raises(CalibrationError, match="only 2 documents"):
        build_calibration(*_config(tiny_model_dir, path, strategy="document", num_samples=3, seq_len=32))
    with pytest.raises(CalibrationError, match="no document has 64 tokens"):
        build_calibration(*_config(tiny_model_dir, path, strategy="document", num_samples=1, seq_len=64))


@pytest.mark.slow
def test_diverse_selection_covers_distinct_topics():
    # Four topics with disjoint vocabularies; topic 0 has most of the windows.
    gen = torch.Generator().manual_seed(0)
    counts = {0: 40, 1: 4, 2: 4, 3: 4}
    candidates = [
        (torch.randint(0, 8, (16,), generator=gen) + 100 * topic).tolist()
        for topic, n in counts.items()
        for _ in range(n)
    ]
    chosen = select_diverse(candidates, 4, seed=0)
    assert sorted(w[0] // 100 for w in chosen) == [0, 1, 2, 3]  # random picks would mostly repeat topic 0


def test_save_load_round_trip_and_refusals(tmp_path, tiny_model_dir, text_corpus, monkeypatch):
    calib = build_calibration(*_config(tiny_model_dir, text_corpus)).calibration
    path = tmp_path / "calib.safetensors"
    calib.save(path)
    loaded = CalibrationSet.load(path)
    assert torch.equal(loaded.input_ids, calib.input_ids) and loaded.metadata == calib.metadata
    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(2)}, str(foreign))
    with pytest.raises(CalibrationError, match="not a quantkit calibration file"):
        CalibrationSet.load(foreign)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    target = tmp_path / "interrupted.safetensors"
    monkeypatch.setattr("quantkit.data.calibration.save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        calib.save(target)
    assert list(tmp_path.glob("*interrupted*")) == []


def test_config_validation():
    for bad in (
        CalibrationConfig(num_samples=0),
        CalibrationConfig(seq_len=1),
        CalibrationConfig(strategy="zigzag"),
        CalibrationConfig(select="best"),
    ):
        with pytest.raises(QuantkitError):
            bad.validate()
