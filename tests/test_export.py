"""CSV export of recordings: every field of every sample, None as an empty cell, untrusted text defused."""

from __future__ import annotations

import csv
import dataclasses
import json
import logging

import pytest

from kvscope.core.base.sample import PHASE_EVENT, Sample
from kvscope.core.records.export import CSV_FIELDS, export_csv, write_csv
from kvscope.core.records.recording import RecordingError, RecordingReader, RecordingWriter
from tests.test_recording import _damaged_recording, make_sample, plain_header, raw_header


def read_csv(path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def parse_cell(field: dataclasses.Field, cell: str):
    """What a spreadsheet user gets back: "" -> None, numbers by the field's type, text as is."""
    if cell == "" and "None" in str(field.type):
        return None
    t = str(field.type)
    if t.startswith("int"):
        return int(cell)
    if t.startswith("float"):
        return float(cell)
    return cell


def test_csv_matches_the_samples(tmp_path):
    rec = tmp_path / "run.jsonl"
    samples = [make_sample(i) for i in range(300)]
    samples.append(make_sample(300, phase=PHASE_EVENT, event="switch", text="cache dynamic -> static, \"q\"\nnext"))
    with RecordingWriter(rec, plain_header()) as w:
        for s in samples:
            w.write(s)
    out = tmp_path / "out.csv"
    assert export_csv(rec, out) == len(samples)

    rows = read_csv(out)
    with open(out, newline="", encoding="utf-8") as f:
        assert next(csv.reader(f)) == list(CSV_FIELDS)
    assert list(CSV_FIELDS) == [f.name for f in dataclasses.fields(Sample)]
    assert len(rows) == len(samples)
    fields = dataclasses.fields(Sample)
    for sample, row in zip(samples, rows):
        rebuilt = Sample(**{f.name: parse_cell(f, row[f.name]) for f in fields})
        assert rebuilt == sample  # ints exact, floats round-trip, text with quotes/newlines/unicode intact
    # "not available" is an empty cell, never 0
    assert rows[0]["allocator_allocated"] == "" and rows[0]["tokens_per_s"] == ""
    assert rows[1]["kv_bytes_held"] == rows[1]["kv_bytes_reserved"] == str(4096 * 2)  # transformers: one figure
    assert not list(tmp_path.glob(".*.tmp"))


def test_formula_text_is_defused_numbers_are_not(tmp_path):
    rec = tmp_path / "evil.jsonl"
    evil = ["=HYPERLINK(\"http://x\",\"click\")", "+1+1", "-2+3", "@SUM(A1)", "\tx", "plain"]
    with RecordingWriter(rec, plain_header()) as w:
        for i, text in enumerate(evil):
            w.write(make_sample(i, text=text))
    out = tmp_path / "out.csv"
    export_csv(rec, out)
    rows = read_csv(out)
    assert [r["text"] for r in rows] == ["'" + t for t in evil[:-1]] + ["plain"]
    export_csv(rec, out, escape_formulas=False)
    assert [r["text"] for r in read_csv(out)] == evil
    # A negative number is a number, not a formula. (A recording holds none: the reader refuses
    # negative counts. write_csv takes any Samples.)
    write_csv([make_sample(1, token=-1)], out)
    assert read_csv(out)[0]["token"] == "-1"


def test_damaged_recording_exports_what_is_readable_and_warns(tmp_path, caplog):
    rec, kept = _damaged_recording(tmp_path, {2: b"garbage", 5: b'{"token": "x"}'})
    out = tmp_path / "out.csv"
    with caplog.at_level(logging.WARNING, logger="kvscope.core.records.export"):
        assert export_csv(rec, out) == len(kept) == 8
    assert [int(r["token"]) for r in read_csv(out)] == [s.token for s in kept]
    assert "skipped 2 damaged lines" in caplog.text


def test_write_csv_with_own_reader_reports_truncation(tmp_path):
    rec = tmp_path / "cut.jsonl"
    lines = [raw_header()] + [json.dumps(make_sample(i).to_dict()) for i in range(5)]
    rec.write_text("\n".join(lines)[:-20])  # the last sample cut off, as a killed writer leaves it
    out = tmp_path / "out.csv"
    reader = RecordingReader(rec)
    assert write_csv(reader, out) == 4
    assert reader.truncated and "cut off" in reader.problem()


def test_strict_export_of_damaged_recording_leaves_no_csv(tmp_path):
    rec, _ = _damaged_recording(tmp_path, {3: b"garbage"})
    out = tmp_path / "out.csv"
    with pytest.raises(RecordingError, match="corrupted at line 5"):
        export_csv(rec, out, strict=True)
    assert not out.exists()
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b'{"format": "kvscope-recording", "version": 9}\n', "recording version 9 is newer"),
    (b"not json\n", "line 1 is not JSON"),
])
def test_export_of_a_bad_file_is_a_clear_error(tmp_path, content, message):
    rec = tmp_path / "bad.jsonl"
    rec.write_bytes(content)
    out = tmp_path / "out.csv"
    with pytest.raises(RecordingError, match=message):
        export_csv(rec, out)
    assert not out.exists()


def test_export_to_a_missing_folder_is_a_clear_error(tmp_path):
    rec = tmp_path / "run.jsonl"
    with RecordingWriter(rec, plain_header()) as w:
        w.write(make_sample(0))
    with pytest.raises(RecordingError, match="cannot write CSV"):
        export_csv(rec, tmp_path / "nope" / "out.csv")
