"""The recording reader's decision for each field a run's quality and runtime add (issue 38, item 6).

Per field, a hostile value in a version 2 recording is either refused as damage (the line skipped and counted,
``problem()`` naming it, ``strict=True`` raising, the writer refusing to write it) or read as the value it is (what a
replay draws and export writes); the valid neighbours of each refused value read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope.core.base.sample import Sample
from kvscope.core.records.recording import (SAMPLE_RULES, RecordingError, RecordingReader, RecordingWriter,
                                            sample_rules)

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "assets" / "demo" / "demo.jsonl"


def _header() -> dict:
    header = json.loads(DEMO.read_text().splitlines()[0])
    header["version"] = 2
    return header


def _decode() -> dict:
    line = next(json.loads(x) for x in DEMO.read_text().splitlines()[1:] if json.loads(x)["phase"] == "decode")
    line.update(quality_top1=1, quality_kl=0.25, quality_token=17, quality_token_text=" the", quality_kv_bytes=4096)
    return line


VOCAB = _header()["model"]["vocab_size"]

#: (field, value, refused?, what the one line says): every value the schema forbids, and its valid neighbours.
CASES = [
    ("quality_top1", 2, True, "quality_top1 must be from 0 to 1"),
    ("quality_top1", -1, True, "quality_top1 must be from 0 to 1"),
    ("quality_top1", True, True, "quality_top1 must be an integer"),
    ("quality_top1", 1.0, True, "quality_top1 must be an integer"),
    ("quality_top1", 0, False, ""),
    ("quality_kl", -0.5, True, "quality_kl must be from 0"),
    ("quality_kl", float("nan"), True, "quality_kl must be a finite number"),
    ("quality_kl", "0.1", True, "quality_kl must be a number"),
    ("quality_kl", 0.0, False, ""),
    ("quality_kl", 80.0, False, ""),  # KL in nats has no upper bound: a large one is drawn
    ("quality_token", VOCAB, True, "is not a token of the recorded model"),
    ("quality_token", 10**12, True, "is not a token of the recorded model"),
    ("quality_token", -1, True, "quality_token must be from 0"),
    ("quality_token", VOCAB - 1, False, ""),
    ("quality_token_text", 7, True, "quality_token_text must be text"),
    ("quality_token_text", "x" * 257, True, "longer than 256 characters"),
    ("quality_token_text", "\x1b[2J\x1b]0;title\x07", False, ""),  # text: escaped where it is printed
    ("quality_kv_bytes", -1, True, "quality_kv_bytes must be from 0"),
    ("quality_kv_bytes", 2**63, True, "quality_kv_bytes must be from 0 to 2**63-1"),
    ("quality_kv_bytes", 2**62, False, ""),  # a huge byte count the range allows is drawn
    ("peak_bytes_observed", -4, True, "peak_bytes_observed must be from 0"),
    ("peak_bytes_observed", 2**62, False, ""),
    ("peak_bytes_predicted", 2**64, True, "peak_bytes_predicted must be from 0 to 2**63-1"),
    ("peak_bytes_predicted", 2**63 - 1, False, ""),
    ("runtime", "", True, "is not a runtime's name"),
    ("runtime", "\x1b[31mred", True, "is not a runtime's name"),
    ("runtime", "llama cpp", True, "is not a runtime's name"),
    ("runtime", None, True, "runtime must not be null"),
    ("runtime", "vllm-0.9+cu12", False, ""),  # one this build lacks: data, shown as recorded
    ("runtime", "llama.cpp", False, ""),
]


def _write(path: Path, *lines: dict) -> Path:
    path.write_text("\n".join(json.dumps(x) for x in (_header(), *lines)) + "\n")
    return path


@pytest.mark.parametrize("field, value, refused, says", CASES, ids=[f"{f}={v!r:.20}" for f, v, *_ in CASES])
def test_each_field_is_refused_or_read_as_its_rule_says(tmp_path, field, value, refused, says):
    good = _decode()
    bad = dict(_decode(), **{field: value}, token=good["token"] + 1)
    reader = RecordingReader(_write(tmp_path / "r.jsonl", good, bad))
    samples = list(reader)
    if refused:
        assert [s.token for s in samples] == [good["token"]]  # the damaged line is skipped, the good one kept
        assert reader.skipped == 1 and says in reader.problem() and "line 3" in reader.problem()
        assert "\n" not in reader.problem()
        with pytest.raises(RecordingError, match="corrupted at line 3"):
            list(RecordingReader(tmp_path / "r.jsonl", strict=True))
    else:
        assert [getattr(s, field) for s in samples] == [getattr(Sample.from_dict(good), field), value]
        assert reader.problem() is None


@pytest.mark.parametrize("field, value", [("quality_token_text", " the"), ("quality_kl", 0.5)])
def test_a_figure_without_the_one_it_belongs_to_is_damage(tmp_path, field, value):
    line = dict(_decode(), quality_token=None, quality_top1=None, quality_kl=None, quality_token_text=None)
    line[field] = value
    reader = RecordingReader(_write(tmp_path / "r.jsonl", line))
    assert list(reader) == [] and reader.skipped == 1
    assert ("without a quality_token" if field == "quality_token_text" else "without quality_top1") in reader.problem()


def test_a_header_without_a_vocabulary_reads_any_token_id(tmp_path):
    header = _header()
    del header["model"]["vocab_size"]
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(header) + "\n" + json.dumps(dict(_decode(), quality_token=10**12)) + "\n")
    assert [s.quality_token for s in RecordingReader(path)] == [10**12]


def test_the_writer_refuses_what_the_reader_would_skip(tmp_path):
    header = _header()
    writer = RecordingWriter(tmp_path / "w.jsonl", header)
    base = Sample.from_dict(_decode())
    writer.write(base)
    for change in ({"quality_token": VOCAB}, {"runtime": "two words"}, {"quality_top1": None},
                   {"quality_token": None}):
        with pytest.raises(RecordingError, match="cannot record sample"):
            writer.write(base.replace(**change))
    writer.close()
    assert [s.token for s in RecordingReader(tmp_path / "w.jsonl")] == [base.token]  # nothing half-written


def test_every_rule_is_named_and_none_fires_on_the_shipped_demo():
    assert set(SAMPLE_RULES) == {"quality_token", "quality_token_text", "quality_kl", "runtime"}
    reader = RecordingReader(DEMO)
    samples = list(reader)
    assert len(samples) == 120 and reader.problem() is None
    assert all(sample_rules(s, VOCAB) is None for s in samples)


# ---------------------------------------------------------------------------------------------------- a seeded fuzzer

#: Per new field, values a file may hold: (value, allowed by the field's own type and range).
POOLS = {
    "quality_top1": [(0, True), (1, True), (None, True), (2, False), (-1, False), (True, False), (0.0, False)],
    "quality_kl": [(0.0, True), (3.5, True), (None, True), (-1e-9, False), ("1", False), (float("inf"), False)],
    "quality_token": [(0, True), (VOCAB - 1, True), (None, True), (VOCAB, True), (2**63, False), (-3, False)],
    "quality_token_text": [(" the", True), (None, True), ("\x07", True), (3, False), ("y" * 300, False)],
    "quality_kv_bytes": [(0, True), (2**62, True), (None, True), (-1, False), (1.5, False)],
    "peak_bytes_observed": [(10, True), (None, True), (2**63 - 1, True), (2**63, False), (False, False)],
    "peak_bytes_predicted": [(10, True), (None, True), (-2, False), ("10", False)],
    "runtime": [("transformers", True), ("llama.cpp", True), ("mlx", True), ("x-1.2", True), ("", True),
                ("a b", True), ("\x1b[0m", True), (None, False), (7, False), ("r" * 257, False)],
}


def _expected(line: dict) -> bool:
    """Whether the reader must keep ``line``: every field's own rule, then the rules between fields (SAMPLE_RULES),
    written here from the schema, independently of the reader."""
    import re

    for field, pool in POOLS.items():
        if not dict((repr(v), ok) for v, ok in pool).get(repr(line[field]), True):  # the demo line's own: valid
            return False
    if line["quality_token"] is not None and line["quality_token"] >= VOCAB:
        return False
    if line["quality_token_text"] is not None and line["quality_token"] is None:
        return False
    if line["quality_kl"] is not None and line["quality_top1"] is None:
        return False
    return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}", line["runtime"]))


def test_seeded_combinations_of_new_field_values(tmp_path):
    import random
    import time

    rng = random.Random(38)
    lines, expected = [], []
    base = _decode()
    for i in range(400):
        line = dict(base, token=base["token"] + i, context_tokens=base["context_tokens"] + i)
        for field, pool in POOLS.items():
            line[field] = rng.choice(pool)[0] if rng.random() < 0.2 else base.get(field, POOLS[field][0][0])
        lines.append(line)
        expected.append(_expected(line))
    path = _write(tmp_path / "fuzz.jsonl", *lines)
    started = time.monotonic()
    reader = RecordingReader(path)
    kept = [s.token for s in reader]
    elapsed = time.monotonic() - started
    want = [line["token"] for line, ok in zip(lines, expected) if ok]
    print(f"\nnew-field fuzzer, seed 38: {len(lines)} lines, {len(want)} valid, {len(lines) - len(want)} damaged, "
          f"read in {elapsed:.2f} s")
    assert kept == want and reader.skipped == len(lines) - len(want)
    assert 50 < len(want) < 350  # both outcomes are exercised
