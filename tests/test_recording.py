"""Recordings: round trip, SIGKILL durability, every damaged-file case, streaming of a large file.

All on real files in tmp_path; the kill test kills a real child process that writes with
RecordingWriter.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from kvscope.core.base.sample import PHASE_DECODE, PHASE_EVENT, PHASE_PREFILL, Sample
from kvscope.core.model.spec import FULL_ATTENTION, SLIDING_ATTENTION, ModelSpec
from kvscope.core.records.recording import (MAX_LINE_BYTES, RECORDING_FORMAT, RECORDING_VERSION, RecordingError,
                                            RecordingReader, RecordingWriter, header_for, iter_samples, read_header)

REPO = Path(__file__).resolve().parent.parent


def tiny_spec() -> ModelSpec:
    """A real ModelSpec value (built directly: loading one from a config is spec's job and slow here)."""
    return ModelSpec(name="tiny-llama", model_type="llama", num_layers=4, num_query_heads=4, num_kv_heads=2,
                     head_dim=16, hidden_size=64, vocab_size=1000, tie_word_embeddings=False,
                     max_position_embeddings=2048, dtype="float32", num_parameters=1_234_567,
                     layer_types=(FULL_ATTENTION, SLIDING_ATTENTION) * 2, sliding_window=256,
                     display_name="Tiny Llama", config={"model_type": "llama", "huge": list(range(10))})


def make_sample(i: int, **changes) -> Sample:
    """A realistic sample at token ``i``: observed and predicted bytes, one unavailable (None)."""
    base = Sample(
        token=i, phase=PHASE_PREFILL if i == 0 else PHASE_DECODE, time_s=i * 0.0125,
        text="The prompt, ünïcode and \"quotes\"\n" if i == 0 else f" tok{i}",
        attention="gqa:2", attn_impl="sdpa", cache="dynamic", kernel="sdpa-math", device="cpu",
        dtype="float32", kv_bytes_held=4096 * (i + 1), kv_bytes_reserved=4096 * (i + 1), kv_bytes_storage=8192 * (i + 1),
        weights_bytes=123_456_789, allocator_allocated=None, process_rss=500_000_000 + i,
        kv_bytes_predicted=4096 * (i + 1), total_predicted=123_456_789 + 4096 * (i + 1),
        tokens_per_s=80.5 if i else None,
    )
    return base.replace(**changes) if changes else base


def plain_header() -> dict:
    return {"app_version": "0.1.0-test", "model": {"name": "tiny"}, "device": {"name": "cpu"},
            "settings": {"attention": "gqa:2", "cache": "dynamic"}}


def write_recording(path: Path, n: int) -> list[Sample]:
    samples = [make_sample(i) for i in range(n)]
    samples.insert(3, make_sample(2, phase=PHASE_EVENT, event="switch", text="attention gqa:2 -> mqa"))
    with RecordingWriter(path, plain_header()) as w:
        for s in samples:
            w.write(s)
    return samples


def raw_header(**changes) -> str:
    h = {"format": RECORDING_FORMAT, "version": RECORDING_VERSION, **plain_header(), **changes}
    return json.dumps(h)


# ------------------------------------------------------------------------------------------------
# Round trip and header


def test_round_trip_many_samples(tmp_path):
    path = tmp_path / "run.jsonl"
    samples = write_recording(path, 2000)
    reader = RecordingReader(path)
    got = list(reader)
    assert got == samples
    assert reader.samples == len(samples) and reader.skipped == 0 and not reader.truncated
    assert reader.problem() is None
    assert reader.header["format"] == RECORDING_FORMAT and reader.version == RECORDING_VERSION
    assert reader.settings["attention"] == "gqa:2"
    # None stays None (not available), never 0; the event survives with its kind
    assert got[0].allocator_allocated is None and got[0].tokens_per_s is None
    assert got[3].event == "switch" and got[3].is_event
    # one line per sample after the header; the file is plain JSONL
    assert len(path.read_bytes().splitlines()) == len(samples) + 1


def test_header_for_a_real_spec(tmp_path):
    spec = tiny_spec()
    header = header_for(spec, "cpu", {"attention": "gqa:2", "cache": "dynamic", "max_new_tokens": 32}, "0.1.0")
    assert header["format"] == RECORDING_FORMAT and header["version"] == RECORDING_VERSION
    model = header["model"]
    assert model["num_layers"] == spec.num_layers and model["num_query_heads"] == spec.num_query_heads
    assert model["num_kv_heads"] == spec.num_kv_heads and model["head_dim"] == spec.head_dim
    assert model["num_parameters"] == spec.num_parameters and model["dtype"] == spec.dtype
    assert model["label"] == "Tiny Llama" and model["layer_types"] == list(spec.layer_types)
    assert model["sliding_window"] == 256 and model["kv_lora_rank"] is None
    assert "config" not in model
    assert header["device"] == {"name": "cpu"}
    assert header["created"].endswith("+00:00")
    path = tmp_path / "h.jsonl"
    with RecordingWriter(path, header) as w:
        w.write(make_sample(0))
    assert read_header(path) == json.loads(json.dumps(header))


def test_header_for_run_settings():
    from kvscope.core.model.attention import parse_attention
    from kvscope.core.model.caches import parse_cache
    from kvscope.core.model.settings import RunSettings

    spec = tiny_spec()
    settings = RunSettings(attention=parse_attention("mqa"), cache=parse_cache("static"), attn_impl="eager")
    header = header_for(spec, {"name": "cuda:0", "total_bytes": 80 * 2**30}, settings, "0.1.0")
    assert header["settings"]["attention"] == "mqa" and header["settings"]["cache"] == "static"
    assert header["settings"]["attn_impl"] == "eager" and header["settings"]["batch"] == 1
    assert header["device"]["total_bytes"] == 80 * 2**30
    json.dumps(header)  # all plain


def test_writer_refuses_to_overwrite_and_write_after_close(tmp_path):
    path = tmp_path / "run.jsonl"
    write_recording(path, 5)
    before = path.read_bytes()
    with pytest.raises(RecordingError, match="already exists"):
        RecordingWriter(path, plain_header())
    assert path.read_bytes() == before  # nothing lost
    w = RecordingWriter(path, plain_header(), overwrite=True)
    w.close()
    w.close()  # idempotent
    with pytest.raises(RecordingError, match="is closed"):
        w.write(make_sample(0))
    assert list(iter_samples(path)) == []
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary header file left behind


def test_writer_rejects_unserialisable_header(tmp_path):
    with pytest.raises(RecordingError, match="header is not plain JSON"):
        RecordingWriter(tmp_path / "x.jsonl", {"model": object()})
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("bad, why", [
    (dict(time_s=float("nan")), "sample time must be a finite number, got nan"),
    (dict(phase="warmup"), "sample phase must be one of prefill, decode, event, got 'warmup'"),
    (dict(kv_bytes_held=1.5), "sample field kv_bytes_held must be an integer, got 1.5"),
    (dict(kv_bytes_reserved=-1), "sample field kv_bytes_reserved must be from 0 to 2**63-1, got -1"),
])
def test_writer_refuses_a_sample_no_reader_would_accept(tmp_path, bad, why):
    path = tmp_path / "run.jsonl"
    with RecordingWriter(path, plain_header()) as w:
        w.write(make_sample(0))
        with pytest.raises(RecordingError, match=re.escape(f"cannot record sample at token 1: {why}")):
            w.write(make_sample(1, **bad))
        w.write(make_sample(2))
    reader = RecordingReader(path)
    assert [s.token for s in reader] == [0, 2] and reader.skipped == 0


def test_header_starts_with_format_and_version(tmp_path):
    path = tmp_path / "run.jsonl"
    RecordingWriter(path, {"app_version": "x", "version": 99, "format": "spoof"}).close()
    assert path.read_bytes().startswith(b'{"format":"kvscope-recording","version":2,"app_version":"x"')


def test_writer_into_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(RecordingError, match="cannot create recording"):
        RecordingWriter(tmp_path / "no" / "such" / "dir" / "x.jsonl", plain_header())


def test_each_sample_reaches_the_os_before_write_returns(tmp_path):
    """A second reader (as a kill would leave it) sees every line as soon as write() returns."""
    path = tmp_path / "live.jsonl"
    with RecordingWriter(path, plain_header(), fsync_interval_s=None) as w:
        for i in range(5):
            w.write(make_sample(i))
            assert [s.token for s in iter_samples(path)] == list(range(i + 1))


# ------------------------------------------------------------------------------------------------
# SIGKILL of a writer

CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from kvscope.core.records.recording import RecordingWriter
    from kvscope.core.base.sample import Sample
    w = RecordingWriter({path!r}, {{"app_version": "kill-test"}})
    i = 0
    while True:
        w.write(Sample(token=i, phase="decode", time_s=i * 0.001, text="x" * (i % 4000), attention="mha",
                       attn_impl="sdpa", cache="dynamic", kernel="sdpa-math", device="cpu", dtype="float32",
                       kv_bytes_held=64 * i, kv_bytes_reserved=64 * i, kv_bytes_storage=None, weights_bytes=1000))
        i += 1
        print(i, flush=True)  # samples written (flushed to the OS) so far
""")


@pytest.mark.skipif(os.name != "posix", reason="SIGKILL is POSIX")
def test_sigkill_mid_recording_keeps_every_flushed_sample(tmp_path):
    path = tmp_path / "killed.jsonl"
    child = subprocess.Popen([sys.executable, "-u", "-c", CHILD.format(repo=str(REPO), path=str(path))],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reported = 0
    deadline = time.monotonic() + 20
    try:
        for line in child.stdout:  # wait until the child has written a good number of samples
            reported = int(line)
            if reported >= 300 or time.monotonic() > deadline:
                break
        child.send_signal(signal.SIGKILL)  # mid-run: it is in its write loop right now
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL, child.stderr.read()
    assert reported >= 300

    reader = RecordingReader(path)
    samples = list(reader)
    assert reader.header["app_version"] == "kill-test"
    assert reader.skipped == 0  # a kill never corrupts a complete line
    # every sample the child had reported as written is there, in order, intact
    assert len(samples) >= reported
    assert [s.token for s in samples] == list(range(len(samples)))
    assert all(s.text == "x" * (s.token % 4000) and s.kv_bytes_reserved == 64 * s.token for s in samples)
    # a partial last line, if the kill landed inside a write, is reported as truncated, not as damage
    if not path.read_bytes().endswith(b"\n"):
        assert reader.truncated and "cut off" in reader.problem()
    else:
        assert not reader.truncated


# ------------------------------------------------------------------------------------------------
# Damaged files: each case has its own message


def test_truncated_last_line_at_every_cut(tmp_path):
    """Cut the file at every byte of the last line: the complete lines are all read, the tail reported."""
    path = tmp_path / "run.jsonl"
    samples = write_recording(path, 4)
    data = path.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    cut_path = tmp_path / "cut.jsonl"
    # 1 .. len-1 bytes of the last line (no newline): every cut near the ends, every 7th in between
    cuts = sorted(set(range(last_start + 1, last_start + 40)) | set(range(last_start + 1, len(data) - 1, 7))
                  | set(range(len(data) - 40, len(data) - 1)))
    for cut in cuts:
        cut_path.write_bytes(data[:cut])
        reader = RecordingReader(cut_path)
        got = list(reader)
        assert got == samples[:-1], cut
        assert reader.truncated and reader.skipped == 0, cut
        assert reader.problem() == "recording cut.jsonl: the last sample was cut off (the recording was interrupted)"
    # the complete last line without its newline (an edited file) is data, not truncation
    cut_path.write_bytes(data[:-1])
    reader = RecordingReader(cut_path)
    assert list(reader) == samples and not reader.truncated


def test_truncated_header(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(raw_header()[:60])
    with pytest.raises(RecordingError, match=r"^recording t.jsonl is truncated: its header line is incomplete$"):
        read_header(path)
    path.write_text("hello")  # no newline, but not a cut-off header either
    with pytest.raises(RecordingError, match=r"^t.jsonl is not a KV Scope recording: line 1 is not JSON$"):
        read_header(path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    with pytest.raises(RecordingError, match=r"^recording empty.jsonl is empty$"):
        RecordingReader(path)
    with pytest.raises(RecordingError, match="is empty"):
        iter_samples(path)  # raised at the call, not at the first next()


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(RecordingError, match="does not exist"):
        read_header(tmp_path / "nope.jsonl")
    with pytest.raises(RecordingError, match="is a folder"):
        read_header(tmp_path)


@pytest.mark.parametrize("first_line, message", [
    ("hello world\n", r"^x.jsonl is not a KV Scope recording: line 1 is not JSON$"),
    ("\n", r"^x.jsonl is not a KV Scope recording: line 1 is blank$"),
    ("[1, 2]\n", r"^x.jsonl is not a KV Scope recording: line 1 is not a JSON object$"),
    ('{"format": "other-tool", "version": 1}\n',
     r"^x.jsonl is not a KV Scope recording: format is 'other-tool', expected 'kvscope-recording'$"),
    ('{"version": 1}\n', r"format is None"),
    ("[" * 100_000 + "\n", r"line 1 is not JSON"),  # nesting bomb: no RecursionError escapes
    ("\x89PNG\r\n", r"line 1 is not JSON"),  # binary file renamed
])
def test_not_a_recording(tmp_path, first_line, message):
    path = tmp_path / "x.jsonl"
    path.write_bytes(first_line.encode("latin-1") if first_line.startswith("\x89") else first_line.encode())
    with pytest.raises(RecordingError, match=message):
        RecordingReader(path)


def test_newer_version(tmp_path):
    path = tmp_path / "future.jsonl"
    path.write_text(raw_header(version=7) + "\n" + json.dumps(make_sample(0).to_dict()) + "\n")
    with pytest.raises(RecordingError) as info:
        read_header(path)
    assert str(info.value) == "recording version 7 is newer than this KV Scope (reads up to 2); update KV Scope"


@pytest.mark.parametrize("version", [0, -3, "1", 1.0, None, True])
def test_unknown_version(tmp_path, version):
    path = tmp_path / "v.jsonl"
    path.write_text(raw_header(version=version) + "\n")
    with pytest.raises(RecordingError, match=r"^recording v.jsonl has an unknown version .*; this KV Scope reads versions 1 to 2$"):
        read_header(path)


def test_bad_header_field_types(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text(raw_header(model="llama") + "\n")
    with pytest.raises(RecordingError, match="bad header: model must be an object, got str"):
        read_header(path)


def _damaged_recording(tmp_path: Path, bad_lines: dict[int, bytes], n: int = 10) -> tuple[Path, list[Sample]]:
    """A recording of n samples where sample lines (0-based) in ``bad_lines`` are replaced."""
    path = tmp_path / "damaged.jsonl"
    samples = [make_sample(i) for i in range(n)]
    lines = [raw_header().encode()] + [json.dumps(s.to_dict()).encode() for s in samples]
    for index, raw in bad_lines.items():
        lines[index + 1] = raw
    path.write_bytes(b"\n".join(lines) + b"\n")
    kept = [s for i, s in enumerate(samples) if i not in bad_lines]
    return path, kept


def test_corrupted_line_in_the_middle_is_skipped_and_reported(tmp_path):
    path, kept = _damaged_recording(tmp_path, {4: b'{"token": 4, "phase": "dec\x00\xff garbage'})
    reader = RecordingReader(path)
    assert list(reader) == kept  # the samples after the damage are not lost
    assert reader.skipped == 1 and not reader.truncated
    assert reader.warnings == ["line 6: not valid JSON"]
    assert reader.problem() == "recording damaged.jsonl: skipped 1 damaged line (first: line 6: not valid JSON)"


def test_corrupted_line_strict_stops_with_the_line_number(tmp_path):
    path, _ = _damaged_recording(tmp_path, {4: b"garbage"})
    with pytest.raises(RecordingError, match=r"^recording damaged.jsonl is corrupted at line 6: not valid JSON$"):
        list(RecordingReader(path, strict=True))


def _sample_line(**changes) -> bytes:
    d = make_sample(1).to_dict()
    d.update(changes)
    return json.dumps(d).encode()


@pytest.mark.parametrize("line, why", [
    (_sample_line(token="five"), "sample field token must be an integer, got 'five'"),
    (_sample_line(kv_bytes_observed=1.5), "sample field kv_bytes_observed must be an integer, got 1.5"),
    (_sample_line(kv_bytes_observed=True), "sample field kv_bytes_observed must be an integer, got True"),
    (_sample_line(time_s="now"), "sample field time_s must be a number, got 'now'"),
    (_sample_line(time_s=False), "sample field time_s must be a number, got False"),
    (_sample_line(text=42), "sample field text must be text, got 42"),
    (_sample_line(token=None), "sample field token must not be null"),
    (_sample_line(phase="warmup"), "sample phase must be one of prefill, decode, event, got 'warmup'"),
    (b'{"token": 1, "time_s": NaN}', "sample is missing phase, text, attention"),
    (_sample_line(time_s=float("nan")), "sample time must be a finite number, got nan"),
    (b'[1, 2, 3]', "a sample must be a JSON object, got list"),
    (b'"just text"', "a sample must be a JSON object, got str"),
    (b'{"token": 1}', "sample is missing phase, time_s, text"),
    (b'{"token": ' + b'9' * 5000 + b'}', "Exceeds the limit (4300 digits)"),  # no DoS by huge ints
])
def test_wrong_type_fields_are_named(tmp_path, line, why):
    path, kept = _damaged_recording(tmp_path, {2: line})
    reader = RecordingReader(path)
    assert list(reader) == kept
    assert reader.skipped == 1
    assert reader.warnings[0].startswith(f"line 4: {why}")
    with pytest.raises(RecordingError, match="corrupted at line 4: " + re.escape(why.split(",")[0])):
        list(RecordingReader(path, strict=True))


def test_unknown_sample_keys_are_ignored(tmp_path):
    """A newer minor writer may add fields; a reader of the same version keeps the ones it knows."""
    path, _ = _damaged_recording(tmp_path, {2: _sample_line(gpu_temperature_c=71)})
    reader = RecordingReader(path)
    assert len(list(reader)) == 10 and reader.skipped == 0


def test_overlong_line_is_refused_with_bounded_memory(tmp_path):
    path, kept = _damaged_recording(tmp_path, {3: b'{"text": "' + b"a" * (MAX_LINE_BYTES * 2) + b'"}'})
    reader = RecordingReader(path)
    assert list(reader) == kept
    assert reader.warnings == ["line 5: longer than 8 MiB"]
    header_path = tmp_path / "bighead.jsonl"
    header_path.write_bytes(b"{" + b" " * (MAX_LINE_BYTES + 10) + b"}\n")
    with pytest.raises(RecordingError, match="line 1 is longer than 8 MiB"):
        read_header(header_path)


def test_blank_lines_and_crlf_are_tolerated(tmp_path):
    path = tmp_path / "edited.jsonl"
    lines = [raw_header()] + [json.dumps(make_sample(i).to_dict()) for i in range(3)]
    path.write_bytes(("\r\n".join(lines[:2]) + "\r\n\r\n" + "\r\n".join(lines[2:]) + "\r\n").encode())
    reader = RecordingReader(path)
    assert [s.token for s in reader] == [0, 1, 2] and reader.skipped == 0


def test_many_damaged_lines_keep_a_bounded_warning_list(tmp_path):
    path, kept = _damaged_recording(tmp_path, {i: b"junk" for i in range(0, 100, 2)}, n=100)
    reader = RecordingReader(path)
    assert list(reader) == kept
    assert reader.skipped == 50 and len(reader.warnings) == 20
    assert reader.problem().startswith("recording damaged.jsonl: skipped 50 damaged lines (first: line 2:")


# ------------------------------------------------------------------------------------------------
# A large recording is streamed


@pytest.mark.slow
def test_large_recording_is_streamed_with_bounded_memory(tmp_path):
    """A 150 MB recording (50k samples of 3 KB) reads with RSS growing by a few MB, not by the file size.

    Size, not line count, is what a whole-file load would show: 50k long lines rather than 200k
    short ones, because reading costs ~20-80 us per line (json + building the frozen Sample) on a
    loaded 2-core machine, and the test must stay a few seconds. The file is three times the memory
    bound, so loading it whole (or keeping the samples: +200 MiB measured) would fail.
    """
    path = tmp_path / "large.jsonl"
    n = 50_000
    with RecordingWriter(path, plain_header(), fsync_interval_s=None):
        pass  # header only; the body is appended below in one buffered pass to keep the test fast
    line_template = json.dumps(make_sample(7).replace(text="t" * 2500).to_dict())
    with open(path, "a", encoding="utf-8") as f:
        for i in range(n):
            f.write(line_template.replace('"token": 7,', f'"token": {i},', 1))
            f.write("\n")
    size = path.stat().st_size
    bound = 50 * 2**20
    assert size > 2 * bound

    process = psutil.Process()
    baseline = process.memory_info().rss
    peak = baseline
    reader = RecordingReader(path)
    count = 0
    last = -1
    for sample in reader:
        count += 1
        last = sample.token
        if count % 2000 == 0:
            peak = max(peak, process.memory_info().rss)
    peak = max(peak, process.memory_info().rss)
    assert count == n and last == n - 1 and reader.skipped == 0 and not reader.truncated
    growth = peak - baseline
    assert growth < bound, f"RSS grew by {growth / 2**20:.1f} MiB while streaming {size / 2**20:.0f} MiB"


# ------------------------------------------------------------------------------------------------
# Hardening round 2 (issue 18): non-regular files, ranges, Unicode, header fields, long texts


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
@pytest.mark.parametrize("kind, message", [
    ("fifo", r"^\S+fifo.jsonl is a FIFO \(named pipe\), not a recording$"),
    ("zero", r"^\S+zero.jsonl is a device, not a recording$"),
    ("folder", r"^\S+folder.jsonl is a folder, not a recording$"),
])
def test_non_regular_files_are_refused_before_reading(tmp_path, kind, message):
    """A FIFO would block the open until a writer came; /dev/zero never ends: both refused at once."""
    path = tmp_path / f"{kind}.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    started = time.monotonic()
    for call in (read_header, RecordingReader):
        with pytest.raises(RecordingError, match=message):
            call(path)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("changes, why", [
    (dict(token=-1), "sample field token must be from 0 to 2**63-1, got -1"),
    (dict(kv_bytes_observed=2**63), "sample field kv_bytes_observed must be from 0 to 2**63-1, got 9223372036854775808"),
    (dict(context_tokens=10**400), "sample field context_tokens must be from 0 to 2**63-1, got an integer of ~400 digits"),
    (dict(time_s=-1e6), "sample field time_s must be from 0 to 1e+09, got -1000000.0"),
    (dict(time_s=10**400), "sample field time_s must be from 0 to 1e+09, got an integer of ~400 digits"),
    (dict(time_s=float("inf")), "sample time must be a finite number, got inf"),
    (dict(tokens_per_s=float("nan")), "sample field tokens_per_s must be a finite number, got nan"),
    (dict(tokens_per_s=-3.0), "sample field tokens_per_s must be from 0 to 1e+09, got -3.0"),
    (dict(text="\ud800"), "sample field text is not valid Unicode (it holds a lone surrogate)"),
    (dict(attention="m" * 300), "sample field attention is longer than 256 characters"),
    (dict(text=["x"] * 10_000), "sample field text must be text, got a JSON array"),
])
def test_values_out_of_range_are_damaged_lines(tmp_path, changes, why):
    """What would be plotted or exported as if valid (negative, NaN, beyond 64 bits, lone surrogate)
    is a damaged line: skipped, counted, named in one short line. The message never repeats a huge value."""
    path, kept = _damaged_recording(tmp_path, {2: _sample_line(**changes)})
    reader = RecordingReader(path)
    assert list(reader) == kept and reader.skipped == 1
    assert reader.warnings == [f"line 4: {why}"]
    with pytest.raises(ValueError, match=re.escape(why)):
        Sample.from_dict(json.loads(_sample_line(**changes)))  # one validator for every untrusted sample


def test_largest_values_are_kept(tmp_path):
    line = _sample_line(kv_bytes_observed=2**63 - 1, token=0, time_s=1e9, tokens_per_s=0)
    path, kept = _damaged_recording(tmp_path, {2: line})
    reader = RecordingReader(path)
    samples = list(reader)
    assert reader.skipped == 0 and len(samples) == len(kept) + 1
    assert samples[2].kv_bytes_reserved == 2**63 - 1


def test_encoded_surrogates_and_bom(tmp_path):
    """Lines are strict UTF-8: CESU-8 surrogate bytes (which json.loads(bytes) lets through) are damage;
    a UTF-8 byte order mark before the header (a file saved by an editor) is tolerated."""
    line = _sample_line(text="SURROGATE").replace(b"SURROGATE", b"\xed\xa0\x80")
    path, kept = _damaged_recording(tmp_path, {1: line})
    reader = RecordingReader(path)
    assert list(reader) == kept and reader.warnings == ["line 3: not valid JSON"]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert len(list(RecordingReader(bom))) == len(kept)


def test_long_texts_are_elided_only_when_asked(tmp_path):
    from kvscope.core.records.recording import ELIDED, MAX_TEXT_CHARS

    path, _ = _damaged_recording(tmp_path, {1: _sample_line(text="x" * 100_000)}, n=3)
    whole = RecordingReader(path)
    assert [len(s.text) for s in whole][1] == 100_000 and whole.elided == 0
    cut = RecordingReader(path, max_text=MAX_TEXT_CHARS)
    texts = [s.text for s in cut]
    assert texts[1] == "x" * MAX_TEXT_CHARS + ELIDED.format(n=100_000 - MAX_TEXT_CHARS)
    assert texts[1].endswith("\u2026[+95,904 chars]") and cut.elided == 1 and cut.problem() is None


@pytest.mark.parametrize("block, key, value, why", [
    ("model", "name", {"a": 1}, "model.name must be text of at most 256 characters, got a JSON object"),
    ("model", "display_name", [1, 2], "model.display_name must be text of at most 256 characters, got a JSON array"),
    ("model", "dtype", {"x": 1}, "model.dtype must be text"),
    ("model", "num_layers", 10**400, "model.num_layers must be an integer from 0 to 2**63-1, got an integer of ~400"),
    ("model", "num_query_heads", -4, "model.num_query_heads must be an integer from 0 to 2**63-1, got -4"),
    ("model", "tie_word_embeddings", "yes", "model.tie_word_embeddings must be true or false, got 'yes'"),
    ("model", "layer_types", ["full_attention", 3], "model.layer_types must be a list of"),
    ("model", "label", "\ud800", "model.label must be text"),
    ("device", "total_memory", 10**400, "device.total_memory must be an integer from 0 to 2**63-1"),
    ("device", "name", ["cuda"], "device.name must be text"),
    ("settings", "max_context", -1, "settings.max_context must be an integer from 0 to 2**63-1, got -1"),
])
def test_header_fields_are_checked_in_the_reader(tmp_path, block, key, value, why):
    """A header field of the wrong type or range (which used to raise TypeError on every stats refresh
    of a replay) is a refusal, one line, by the reader: export and replay alike."""
    header = json.loads(raw_header())
    header.setdefault(block, {})[key] = value
    path = tmp_path / "h.jsonl"
    path.write_text(json.dumps(header) + "\n" + json.dumps(make_sample(0).to_dict()) + "\n")
    with pytest.raises(RecordingError) as info:
        RecordingReader(path)
    message = str(info.value)
    assert message.startswith(f"recording h.jsonl has a bad header: {why}") and "\n" not in message
    assert len(message) < 200


@pytest.mark.parametrize("changes, why", [
    (dict(num_query_heads=10**9), "query heads"),  # the calculator lists the divisors: it would hang
    (dict(num_kv_heads=0), "KV heads"),
    (dict(num_layers=5000), "model.num_layers must be from 1 to 4,096"),
    (dict(layer_types=["full_attention"]), "model.layer_types has 1 entries for 4 layers"),
    (dict(dtype="float7"), "model.dtype 'float7' is not a dtype"),
])
def test_spec_from_header_refuses_shapes_the_window_cannot_show(changes, why):
    from kvscope.core.records.recording import header_for, spec_from_header

    header = header_for(tiny_spec(), "cpu", {"attention": "gqa:2"}, "test")
    assert spec_from_header(header).num_layers == 4
    header["model"].update(changes)
    with pytest.raises(RecordingError, match=re.escape(why)):
        spec_from_header(header)


@pytest.mark.parametrize("model_type", ["mamba2", "mimo_v2_flash", "falcon_h1"])
def test_a_recording_of_a_model_with_states_or_layer_shapes_writes_and_replays(model_type, tmp_path):
    """Models whose spec carries per-layer states (Mamba's, the hybrids') or K/V shapes of their own (MiMo's window
    layers): the header is written (LayerState is stored as its JSON list) and read back to the same spec, and the
    kinds of layer it names (no_kv included) are accepted."""
    from kvscope.core.model.sources import load_spec
    from kvscope.core.records.recording import spec_from_header
    from tests import archs

    pytest.importorskip("torch")
    try:
        folder = archs.build_tiny_folder(model_type, tmp_path)
    except archs.TinyBuildError as exc:
        pytest.skip(str(exc))
    spec = load_spec(str(folder))
    assert spec.layer_states is not None or spec.layer_kv is not None
    path = tmp_path / "r.jsonl"
    with RecordingWriter(path, header_for(spec, "cpu", {"cache": "dynamic"}, "0.1.0")) as w:
        w.write(make_sample(0))
    back = spec_from_header(read_header(path))
    assert (back.layer_types, back.layer_states, back.layer_kv) == (spec.layer_types, spec.layer_states, spec.layer_kv)
    assert back == spec  # every field but the raw config (not compared)
    damaged = read_header(path)
    damaged["model"]["layer_kv" if spec.layer_kv is not None else "layer_states"] = [[1, 2]]
    with pytest.raises(RecordingError, match="bad header"):
        spec_from_header(damaged)
