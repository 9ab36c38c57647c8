"""Issue 38, hardening round 4: the command line's outputs and inputs (prompt files, full or closed standard
output, a full disk, a recording's escapes in CSV, negative and malformed values).

Every case must end in one ``kvscope:`` line in KV Scope's words with exit status 2: never a traceback, never
"internal error", never argparse's usage text, never a hang; a recording already written is kept, a partial
output file is removed. Where the behaviour is the process's (a FIFO that blocks, /dev/full, a closed descriptor
1, what reaches a terminal), a real child process of ``main.py`` runs; the rest drives ``main.main`` in this
process. The full disk is a real tmpfs of 4-24 KiB where this machine lets the test mount one, else a fake at
the write boundary (the temporary file's ``open`` in ``kvscope.core.records.outputs``).

Case -> test (all in this file)

1. --prompt-file /dev/zero read until the OOM killer, a FIFO blocked forever
  a character device, a FIFO, links to them, a folder, a socket: refused before anything loads, unread
  (real process, < 60 s)                   test_prompt_file_not_regular_refused_unread[<kind>]
  more than MAX_PROMPT_FILE_BYTES (a sparse file, never read), exactly the limit read, line ends as text mode
                                           test_prompt_file_bounded_in_size
2. full or closed outputs
  stdout is /dev/full: export --csv -, calc, calc --json, replay --screenshot -, run's table (real process)
                                           test_stdout_full_is_one_line[<command>]
  stdout closed (>&-): the same commands and watch refused before any work; export to a file still works
  (real process)                           test_stdout_closed_is_one_line[<command>],
                                           test_stdout_closed_export_to_a_file_still_works
  run's table fills its disk mid-run: one line with the token; the recording is kept, readable, its last
  event the error (real tmpfs)             test_run_table_fills_its_disk_recording_kept
  export onto a full filesystem, 4-24 KiB, new file and --force over an old one: one line naming the file,
  no temporary left, the old file as it was
                                           test_export_onto_a_full_filesystem[<size>-<new|existing>]
3. export --csv - wrote a recording's escape sequences raw
  every control / bidi character in the recording's text cells, escaped on stdout (still CSV, one row per
  line), verbatim in a file (real process) test_csv_on_stdout_escapes_controls_and_parses
4. argparse's generic text for negative and malformed values
  the issue's five cases, exact lines     test_issue_cases_answered_in_kvscope_words[<case>]
  a seeded list of amount and count flags x bad values, as `--flag value` and `--flag=value`: the same one
  line, naming the flag                   test_flag_bad_values_name_the_flag[<seed case>]
  values that take a dash stay values and nothing else is glued
                                           test_dash_values_glued_only_after_a_value_option
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvscope import main
from kvscope.core.base.safe_text import safe_text
from kvscope.core.records import outputs
from kvscope.core.records.recording import RecordingReader
from kvscope.core.runtimes.transformers import loading
from tests.helpers import one_line_error
from tests.test_hardening_outputs import CSV_HEADER, DEMO, _env, _recording

ROOT = Path(__file__).resolve().parent.parent
MAIN = str(ROOT / "main.py")
#: What a refusal must never look like.
NOT_OURS = ("Traceback", "internal error", "usage:", "error: argument", "Exception ignored", "expected one argument")


def _child(*argv, stdout=subprocess.PIPE, close_stdout: bool = False, timeout: float = 120, cwd=None):
    """``main.py ARGV`` in a real child process; (exit status, stdout or "", stderr, seconds)."""
    start = time.monotonic()
    out = subprocess.run([sys.executable, MAIN, *map(str, argv)], stdout=None if close_stdout else stdout,
                         stderr=subprocess.PIPE, text=True, cwd=cwd or ROOT, timeout=timeout,
                         env=_env(HF_HUB_OFFLINE="1", QT_QPA_PLATFORM="offscreen"),
                         preexec_fn=(lambda: os.close(1)) if close_stdout else None)
    return out.returncode, out.stdout or "", out.stderr, time.monotonic() - start


def _the_line(code: int, err: str) -> str:
    """The one ``kvscope:`` line of a refusal (exit 2), with nothing of Python's or argparse's around it."""
    assert not any(bad in err for bad in NOT_OURS), err
    return one_line_error(code, err)


def _cli(capsys, *argv) -> tuple[int, str, str]:
    """``main.main(argv)`` in this process; argparse's own exit (its usage text) is a failure of the case."""
    try:
        code = main.main([str(a) for a in argv])
    except SystemExit as exc:  # argparse answered with its generic text
        out, err = capsys.readouterr()
        pytest.fail(f"argparse answered {argv}: exit {exc.code}: {err.strip().splitlines()[-1:]}")
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def nothing_loads(monkeypatch):
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded before the refusal"))


# ================================================================================================
# 1. Prompt files


def _make_not_regular(kind: str, folder: Path) -> tuple[Path, str]:
    """A path of ``kind`` and how the refusal names what it is."""
    if kind == "dev-zero":
        return Path("/dev/zero"), "a character device"
    if kind == "fifo":
        path = folder / "prompt.fifo"
        os.mkfifo(path)
        return path, "a FIFO (named pipe)"
    if kind == "link-to-fifo":
        os.mkfifo(folder / "real.fifo")
        (folder / "prompt.txt").symlink_to(folder / "real.fifo")
        return folder / "prompt.txt", "a FIFO (named pipe) (through a symbolic link)"
    if kind == "link-to-dev-zero":
        (folder / "zero.txt").symlink_to("/dev/zero")
        return folder / "zero.txt", "a character device (through a symbolic link)"
    if kind == "folder":
        (folder / "prompts").mkdir()
        return folder / "prompts", "a folder"
    path = folder / "prompt.sock"  # a socket nobody listens on
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.close()
    return path, "a socket"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "link-to-fifo", "link-to-dev-zero", "folder", "socket"])
def test_prompt_file_not_regular_refused_unread(kind, tmp_path):
    """/dev/zero was read until the OOM killer ended the process; a FIFO with no writer blocked forever."""
    path, what = _make_not_regular(kind, tmp_path)
    code, _out, err, seconds = _child("run", "--device", "cpu", "--tokens", "2", "--prompt-file", path, timeout=60)
    assert _the_line(code, err) == f"kvscope: --prompt-file {path} is {what}, not a regular file; give a text file"
    assert "loading weights" not in err and seconds < 60  # refused before the model, at once


def test_prompt_file_bounded_in_size(tmp_path, capsys, nothing_loads):
    limit = main.MAX_PROMPT_FILE_BYTES
    assert limit == 4 << 20
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # sparse: the refusal is by its size, nothing of it is read
        f.truncate(limit + 1)
    line = _the_line(*_cli(capsys, "run", "--device", "cpu", "--prompt-file", big)[::2])
    assert line == (f"kvscope: --prompt-file {big} is 4.0 MiB ({limit + 1:,} bytes); it may be at most 4.0 MiB "
                    f"({limit:,} bytes), so it was not read")
    exact = tmp_path / "exact.txt"
    exact.write_bytes(b"a\r\nb\rc" + b"x" * (limit - 6))
    text = main.read_prompt_file(str(exact))  # the limit itself is allowed; line ends as text mode reads them
    assert text.startswith("a\nb\nc") and len(text) == limit - 1  # one \\r\\n became \\n


# ================================================================================================
# 2. Full and closed outputs


FULL = "kvscope: cannot write to standard output (/dev/full): No space left on device"
STDOUT_COMMANDS = {  # command: (argv, the line on /dev/full)
    "export-csv": (("export", DEMO, "--csv", "-"), FULL),
    "calc": (("calc",), FULL),
    "calc-json": (("calc", "--json"), FULL),
    "replay-screenshot": (("replay", DEMO, "--screenshot", "-", "--speed", "1000"), f"kvscope: could not save -: {FULL[9:]}"),
    "run": (("run", "--device", "cpu", "--tokens", "2"), f"{FULL}; the run stopped before its first token"),
}


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize("command", list(STDOUT_COMMANDS))
def test_stdout_full_is_one_line(command, tmp_path):
    argv, expected = STDOUT_COMMANDS[command]
    with open("/dev/full", "w") as full:
        code, _out, err, _s = _child(*argv, stdout=full, cwd=tmp_path)
    assert _the_line(code, err) == expected
    assert list(tmp_path.iterdir()) == []  # nothing left behind


CLOSED = {  # command: (argv, the line with descriptor 1 closed)
    "export-csv": (("export", DEMO, "--csv", "-"),
                   "kvscope: standard output is closed, and - means standard output; give a file name"),
    "calc": (("calc",), "kvscope: standard output is closed, and calc prints its figures there "
                        "(>/dev/null discards them)"),
    "replay-screenshot": (("replay", DEMO, "--screenshot", "-"),
                          "kvscope: standard output is closed, and - means standard output; give a file name"),
    "run": (("run", "--device", "cpu", "--tokens", "2"),
            "kvscope: standard output is closed, and run prints its table there (>/dev/null discards it)"),
    "watch": (("watch", "http://127.0.0.1:9", "--count", "1"),
              "kvscope: standard output is closed, and watch prints its readings there (>/dev/null discards them)"),
}


@pytest.mark.parametrize("command", list(CLOSED))
def test_stdout_closed_is_one_line(command, tmp_path):
    """`>&-` gave "AttributeError: 'NoneType' object has no attribute 'flush'" (export --csv -) or printed
    nothing with exit 0 (calc). Refused before any work: run loads nothing."""
    argv, expected = CLOSED[command]
    code, _out, err, _s = _child(*argv, close_stdout=True, cwd=tmp_path)
    assert _the_line(code, err) == expected
    assert "loading weights" not in err and list(tmp_path.iterdir()) == []


def test_stdout_closed_export_to_a_file_still_works(tmp_path):
    """Where standard output is not the output, a closed one is no error; and no file takes descriptor 1."""
    rec = _recording(tmp_path)
    code, _out, err, _s = _child("export", rec, "--csv", tmp_path / "out.csv", close_stdout=True)
    assert code == 0 and err == "", err
    rows = (tmp_path / "out.csv").read_text().splitlines()
    assert rows[0].startswith(CSV_HEADER) and len(rows) == 40


def _mount_tmpfs(folder: Path, size: str) -> bool:
    folder.mkdir(exist_ok=True)
    if os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    return done.returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    """A function mounting a real tmpfs of a given size (None when this machine does not let the test)."""
    mounted = []

    def mount(size: str) -> Path | None:
        folder = tmp_path / f"disk-{size}"
        if not _mount_tmpfs(folder, size):
            return None
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", str(folder)], capture_output=True)


def test_run_table_fills_its_disk_recording_kept(tmp_path, small_disk):
    """run's table on a 4 KiB disk fills it after about 25 tokens: one line with the token, and the recording
    (on another disk) keeps every sample up to there, its last event the error."""
    disk = small_disk("4k")
    if disk is None:
        pytest.skip("cannot mount a tmpfs here (needs root and mount)")
    table, record = disk / "table.txt", tmp_path / "run.jsonl"
    with open(table, "w") as out:
        code, _out, err, _s = _child("run", "--device", "cpu", "--tokens", "80", "--record", record, stdout=out)
    line = _the_line(code, err)
    match = re.fullmatch(rf"kvscope: cannot write to standard output \({re.escape(str(table))}\): No space left on "
                         rf"device; the run stopped at token (\d+); the recording {re.escape(str(record))} keeps every "
                         r"token up to there", line)
    assert match, line
    stopped = int(match.group(1))
    assert 0 < stopped < 80
    with RecordingReader(record) as reader:
        samples = list(reader)
        assert reader.problem() is None
    tokens = [s.token for s in samples if s.phase == "decode"]
    assert tokens == list(range(1, stopped + 1))  # every token up to the one whose row did not fit
    assert samples[-1].event == "error" and "No space left on device" in samples[-1].text


class _FillsAfter:
    """A file that takes ``room`` bytes and then fails as a full disk does (ENOSPC), on write and on close."""

    def __init__(self, real, room: int):
        self.real, self.room = real, room

    def write(self, data):
        self.room -= len(data)
        if self.room < 0:
            raise OSError(28, "No space left on device")
        return self.real.write(data)

    def close(self):
        self.real.close()
        if self.room < 0:
            raise OSError(28, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing"])
@pytest.mark.parametrize("size", ["4k", "8k", "12k", "16k", "20k", "24k"])
def test_export_onto_a_full_filesystem(size, existing, tmp_path, small_disk, capsys, monkeypatch):
    """The 120-sample demo's CSV is 25 KiB: every size fails somewhere else (a write, the flush, close, fsync).
    An 8 KiB tmpfs ended in "internal error: OSError" (close flushed again after the one-line error)."""
    disk = small_disk(size)
    if disk is None:  # the fake at the write boundary: the temporary file fills after SIZE bytes
        disk = tmp_path / "fake-disk"
        disk.mkdir()
        room = int(size[:-1]) * 1024
        real_open = open
        monkeypatch.setattr(outputs, "open", lambda *a, **k: _FillsAfter(real_open(*a, **k), room), raising=False)
    target = disk / "out.csv"
    if existing:
        target.write_text("the old export\n")
    code, out, err = _cli(capsys, "export", DEMO, "--csv", target, *(("--force",) if existing else ()))
    assert _the_line(code, err) == f"kvscope: cannot write {target}: No space left on device"
    assert out == ""
    assert sorted(p.name for p in disk.iterdir()) == (["out.csv"] if existing else [])  # no temporary left
    if existing:
        assert target.read_text() == "the old export\n"


# ================================================================================================
# 3. A recording's text on a terminal


#: Every kind of character safe_text escapes: C0 controls, DEL, C1 controls, the separators, bidi marks.
UNSAFE = [chr(c) for c in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0), 0x061C, 0x200E, 0x200F, 0x2028, 0x2029,
                           *range(0x202A, 0x202F), *range(0x2066, 0x206A))]


def _hostile_recording(folder: Path) -> tuple[Path, list[str]]:
    """The demo's first 40 lines, the decode samples' text (and one event's) holding seeded unsafe characters."""
    rng = random.Random(38)
    lines = DEMO.read_text(encoding="utf-8").splitlines()[:40]
    texts = []
    for i, line in enumerate(lines):
        sample = json.loads(line)
        if sample.get("phase") not in ("decode", "event") or "text" not in sample:
            continue
        picked = rng.sample(UNSAFE, 4) + ["\x1b]0;owned\x07", "\x1b[2J", "\r"]
        rng.shuffle(picked)
        sample["text"] = "tok" + "".join(f"{c}x" for c in picked)
        texts.append(sample["text"])
        lines[i] = json.dumps(sample)
    path = folder / "hostile.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, texts


def test_csv_on_stdout_escapes_controls_and_parses(tmp_path):
    rec, texts = _hostile_recording(tmp_path)
    assert len(texts) > 30 and {c for t in texts for c in t} >= {"\x1b", "\r", "\x07"}
    code, out, err, _s = _child("export", rec, "--csv", "-")
    assert code == 0 and "Traceback" not in err, err
    body = out.replace("\r\n", "\n")  # csv's own line ends
    assert not any(c in body for c in UNSAFE if c != "\n"), "a raw control character reached standard output"
    rows = list(csv.reader(io.StringIO(out, newline="")))
    assert len(body.splitlines()) == len(rows) == 40  # one row per line: no raw line break in a cell
    column = rows[0].index("text")
    hostile = [row[column] for row in rows[1:] if row[column].startswith("tok")]
    assert hostile == [safe_text(t) for t in texts]
    # A file keeps the text as it was, quoted by the csv module.
    code, _out, err, _s = _child("export", rec, "--csv", tmp_path / "out.csv")
    assert code == 0, err
    with open(tmp_path / "out.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert [row[column] for row in rows[1:] if row[column].startswith("tok")] == texts


# ================================================================================================
# 4. Negative and malformed values


ISSUE_CASES = {
    "context-negative": (("calc", "--context", "-4k"),
                         "kvscope: --context must be a positive token count, e.g. 4096 or 4k (got '-4k')"),
    "gpu-memory-negative": (("calc", "--gpu-memory", "-8GiB"),
                            "kvscope: --gpu-memory must be a positive size, e.g. 24GiB or 512MiB (got '-8GiB')"),
    "kv-cache-memory-negative": (("calc", "--runtime", "vllm", "--gpu-memory", "24GiB", "--kv-cache-memory", "-1"),
                                 "kvscope: --kv-cache-memory must be a positive size, e.g. 24GiB or 512MiB (got '-1')"),
    "switch-negative-token": (("run", "--device", "cpu", "--switch", "-5:attention=mqa"),
                              "kvscope: --switch '-5:attention=mqa': T is the token to switch at, 0 or more; write "
                              "T:KEY=VALUE, e.g. 32:attention=mqa"),
    "tensor-parallel-expression": (("calc", "--tensor-parallel", "2**40"),
                                   "kvscope: --tensor-parallel '2**40' is not a whole number; write it in digits, e.g. "
                                   "--tensor-parallel 1"),
}


@pytest.mark.parametrize("case", list(ISSUE_CASES))
def test_issue_cases_answered_in_kvscope_words(case, capsys, nothing_loads):
    argv, expected = ISSUE_CASES[case]
    assert _the_line(*_cli(capsys, *argv)[::2]) == expected


#: (command, flag, kind): every amount and count flag of calc and run.
FLAGS = [
    ("calc", "--context", "tokens"), ("calc", "--max-context", "tokens"), ("calc", "--max-model-len", "tokens"),
    ("calc", "--gpu-memory", "size"), ("calc", "--kv-cache-memory", "size"), ("calc", "--non-torch-memory", "size0"),
    ("calc", "--cudagraph-memory", "size0"), ("calc", "--tensor-parallel", "count"),
    ("calc", "--pipeline-parallel", "count"), ("calc", "--batch", "count"), ("calc", "--block-size", "count"),
    ("run", "--max-context", "tokens"), ("run", "--context", "tokens"), ("run", "--memory-budget", "size"),
    ("run", "--batch", "count"), ("run", "--tokens", "count"), ("run", "--seed", "count"),
]
UNITS = {"tokens": ["", "k", "K", "m"], "size": ["", "B", "KiB", "MiB", "GiB", "GB", "k", "g"], "count": [""]}
MALFORMED = ["2**40", "1.5", "1e3", "0x10", "four", "1/2", "-", "3-", "½"]


def _bad_values(kind: str, rng: random.Random, n: int = 4) -> list[str]:
    """``n`` seeded bad values of a kind: negatives in its units (an integer or a fraction), zero where it is
    refused, and (counts) expressions that are not whole numbers."""
    units = UNITS[kind.rstrip("0")]
    values = {f"-{rng.choice([rng.randint(1, 10**6), round(rng.uniform(0.01, 64), 2)])}{rng.choice(units)}"
              for _ in range(n)}
    if kind in ("tokens", "size"):
        values.add("0")
    if kind == "count":
        values.update(rng.sample(MALFORMED, 2))
    return sorted(values)


CASES = [(command, flag, value) for command, flag, kind in FLAGS
         for value in _bad_values(kind, random.Random(f"38-{command}{flag}"))]


@pytest.mark.parametrize(("command", "flag", "value"), CASES, ids=[f"{c}{f}={v}" for c, f, v in CASES])
def test_flag_bad_values_name_the_flag(command, flag, value, capsys, nothing_loads):
    """`--context -4k` got argparse's "expected one argument" (it took -4k for an option); `--tensor-parallel
    2**40` its "invalid int value". Both spellings give the same one line, and it names the flag."""
    base = ["calc"] if command == "calc" else ["run", "--device", "cpu"]
    if flag == "--kv-cache-memory":
        base += ["--runtime", "vllm", "--gpu-memory", "24GiB"]
    lines = {_the_line(*_cli(capsys, *base, *spelling)[::2]) for spelling in ([flag, value], [f"{flag}={value}"])}
    assert len(lines) == 1, lines
    line = lines.pop()
    assert line.startswith(f"kvscope: {flag}"), line


def test_dash_values_glued_only_after_a_value_option():
    parser = main.build_parser()
    glue = main.glue_dash_values
    assert glue(parser, ["calc", "--context", "-4k", "--gpu-memory", "-.5GiB"]) == ["calc", "--context=-4k",
                                                                                     "--gpu-memory=-.5GiB"]
    assert glue(parser, ["run", "-c", "-4k", "-ngl", "-1"]) == ["run", "-c=-4k", "-ngl=-1"]  # short spellings
    assert glue(parser, ["calc", "--json", "-4k"]) == ["calc", "--json", "-4k"]  # --json takes no value
    assert glue(parser, ["run", "--prompt", "--", "--switch", "-5:a=b"]) == ["run", "--prompt", "--", "--switch",
                                                                             "-5:a=b"]
    assert glue(parser, ["calc", "--model", "-my-model"]) == ["calc", "--model", "-my-model"]  # not a number
    # A negative value that was already valid stays valid: llama.cpp's -ngl -1 is "all layers".
    args = parser.parse_args(glue(parser, ["calc", "--runtime", "llama.cpp", "-ngl", "-1", "--context", "4k"]))
    assert args.n_gpu_layers == -1 and args.context == "4k"
