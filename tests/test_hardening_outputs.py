"""Issue 18, hardening round 2: the files KV Scope writes (item 1) and the minor cases (item 8), one test each.

Everything here drives the real code: the CLI through ``main.main([...])`` in-process, or a real
child process where the exit status, a signal, standard output or a kill is the point; real
recordings (the shipped demo, cut down, with damaged lines), real files, links, FIFOs and devices
(/dev/null, /dev/stdout); the embedded model on the CPU. Nothing is faked except, in the tests
that prove a refusal comes *before* loading, ``kvscope.core.runtimes.transformers.loading.load_model`` (replaced by a function
that fails the test if it is ever called).

Case -> test (all in this file)

Item 1: outputs (one rule, core/records/outputs.py)
  export / replay --screenshot over the recording itself (same name, another spelling, a link;
  with --force too; the window's export_csv too) .. test_output_never_the_input[export|replay]
  an existing file: refused, --force replaces it (keeping its mode)
                                             test_output_existing_file_needs_force
  ... and for --screenshot (real replay) ... test_output_screenshot_force_replaces_existing_png
  a read-only file, even with --force ...... test_output_read_only_file_refused_even_with_force
  a symbolic link: written through to its file; a link to nothing refused
                                             test_output_symlink_written_through_dangling_refused
  --csv - writes to standard output, no file named "-" (real process)
                                             test_output_dash_is_standard_output
  devices, FIFO, folder, link to a device: refused, left as they are
                                             test_output_non_regular_refused[<case>]
  /dev/stdout (a link to a pipe), with --force (real process)
                                             test_output_dev_stdout_never_replaced
  a missing folder is refused, not created . test_output_missing_folder_refused_not_created[export|replay]
Item 8: minor cases
  SIGTERM ends `run` like Ctrl+C: stop event, readable recording, summary (real process)
                                             test_sigterm_stops_run_cleanly
  run --record/--snapshot refused before anything loads (CLI: before torch is imported; and
  run_generation, for the window's runs);
  --force replaces the recording ........... test_run_outputs_refused_before_loading[<case>],
                                             test_run_generation_refuses_record_before_loading,
                                             test_run_record_force_replaces
  replay: one summary line for damaged lines (real process)
                                             test_replay_damaged_lines_one_summary_line
  file names with a newline stay on one line test_file_names_with_control_characters_stay_on_one_line
  a killed first build's .build-* folder is removed at the next build (real process killed)
                                             test_embedded_stale_build_folders_removed
  budget messages count tokens like Sample.token (exact messages)
                                             test_budget_messages_name_the_refused_token[<case>]
  replay --screenshot leaves no kvscope-screenshot-*.ini in the temp folder, and sweeps those of
  dead processes (real process) ........... test_replay_screenshot_leaves_no_settings_file
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvscope import main
from kvscope.core.model.spec import human_bytes
from kvscope.core.records.export import export_csv
from kvscope.core.records.outputs import display_path
from kvscope.core.records.recording import RecordingError, RecordingReader

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "assets" / "demo" / "demo.jsonl"
CSV_HEADER = "token,phase,time_s,text,"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "KVSCOPE_DEBUG"}
    env.update(extra)
    return env


def _recording(folder: Path, name: str = "t.jsonl", lines: int = 40, damaged: tuple[int, ...] = ()) -> Path:
    """The first ``lines`` lines of the shipped demo recording, with garbage at the given line numbers."""
    with open(DEMO, encoding="utf-8") as f:
        kept = [next(f) for _ in range(lines)]
    for number in sorted(damaged):
        kept.insert(number - 1, "{not json at all\n" if number % 2 else '{"token": "x"}\n')
    path = folder / name
    path.write_text("".join(kept), encoding="utf-8")
    return path


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _refused(code: int, err: str) -> str:
    """The one line of a refusal (exit 2, no traceback)."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def rec(tmp_path) -> Path:
    return _recording(tmp_path)


# ------------------------------------------------------------------------------------------------
# Item 1: outputs


@pytest.mark.parametrize("command", ["export", "replay"])
def test_output_never_the_input(tmp_path, rec, capsys, command):
    before = rec.read_bytes()
    (tmp_path / "link.jsonl").symlink_to(rec)
    option = "--csv" if command == "export" else "--screenshot"
    for spelling in (rec, f"{tmp_path}/./{rec.name}", tmp_path / "link.jsonl"):
        for force in ((), ("--force",)):
            code, out, err = _cli(capsys, command, rec, option, spelling, *force)
            line = _refused(code, err)
            assert line.startswith(f"kvscope: {spelling} is the input file") and "refusing to overwrite it" in line
            assert out == "" and rec.read_bytes() == before
    if command == "export":  # the window's File > Export CSV goes through export_csv: same rule
        with pytest.raises(RecordingError, match="is the input file"):
            export_csv(rec, tmp_path / "link.jsonl")
        assert rec.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "t.jsonl"]  # no temporary file left


@pytest.mark.parametrize("name", ["a" * 246 + ".csv", "\u00e9" * 125 + ".csv", "b" * 251 + ".csv"],
                         ids=["250 ASCII", "254 bytes of UTF-8", "255 bytes"])
def test_output_names_up_to_255_bytes_work(tmp_path, rec, capsys, name):
    """A valid name of 250-255 bytes was refused: the temporary file beside it (.NAME.PID.RANDOM.tmp) passed the
    255-byte limit. The temporary's NAME is cut now; new and replaced (--force) files both work, none is left."""
    out_csv = tmp_path / name
    for force in ((), ("--force",)):
        code, out, err = _cli(capsys, "export", rec, "--csv", out_csv, *force)
        assert code == 0 and err == "" and out.strip() == f"wrote 39 samples to {out_csv}", err
        assert out_csv.read_text().startswith(CSV_HEADER)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, "t.jsonl"])  # no temporary left
    code, out, err = _cli(capsys, "export", rec, "--csv", tmp_path / ("c" * 256 + ".csv"))
    assert code != 0 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err  # too long: one line


def test_output_existing_file_needs_force(tmp_path, rec, capsys):
    out_csv = tmp_path / "out.csv"
    out_csv.write_text("keep me\n")
    os.chmod(out_csv, 0o640)
    code, out, err = _cli(capsys, "export", rec, "--csv", out_csv)
    assert _refused(code, err) == f"kvscope: {out_csv} already exists; add --force to replace it"
    assert out_csv.read_text() == "keep me\n"
    code, out, err = _cli(capsys, "export", rec, "--csv", out_csv, "--force")
    assert code == 0 and out.strip() == f"wrote 39 samples to {out_csv}" and err == ""
    assert out_csv.read_text().startswith(CSV_HEADER) and len(out_csv.read_text().splitlines()) == 40
    assert stat.S_IMODE(out_csv.stat().st_mode) == 0o640  # a replaced file keeps its permissions
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv", "t.jsonl"]


def test_output_read_only_file_refused_even_with_force(tmp_path, rec, capsys):
    out_csv = tmp_path / "ro.csv"
    out_csv.write_text("read only\n")
    os.chmod(out_csv, 0o444)
    code, _out, err = _cli(capsys, "export", rec, "--csv", out_csv)
    assert "already exists" in _refused(code, err)
    code, _out, err = _cli(capsys, "export", rec, "--csv", out_csv, "--force")
    assert _refused(code, err) == f"kvscope: {out_csv} is read-only; refusing to replace it"
    assert out_csv.read_text() == "read only\n" and stat.S_IMODE(out_csv.stat().st_mode) == 0o444


def test_output_symlink_written_through_dangling_refused(tmp_path, rec, capsys):
    target = tmp_path / "real.csv"
    target.write_text("old\n")
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    code, _out, err = _cli(capsys, "export", rec, "--csv", link)
    assert _refused(code, err) == (f"kvscope: {link} already exists; add --force to replace it (a symbolic link: "
                                   f"--force writes through it to {target}, the link stays)")
    code, out, err = _cli(capsys, "export", rec, "--csv", link, "--force")
    assert code == 0, err
    # The link is still a link to the same file, and that file has the CSV.
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text().startswith(CSV_HEADER)
    dangling = tmp_path / "dangling.csv"
    dangling.symlink_to(tmp_path / "nowhere" / "x.csv")
    code, _out, err = _cli(capsys, "export", rec, "--csv", dangling, "--force")
    assert _refused(code, err) == (f"kvscope: {dangling} is a symbolic link to a missing file; refusing to follow it "
                                   "(remove the link or give another name)")
    assert not (tmp_path / "nowhere").exists()


def test_output_dash_is_standard_output(tmp_path, rec):
    out = subprocess.run([sys.executable, str(ROOT / "main.py"), "export", str(rec), "--csv", "-"],
                         capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(CSV_HEADER) and len(lines) == 40  # only the CSV on stdout
    assert out.stderr.strip() == "wrote 39 samples to standard output"
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("case", ["dev-null", "fifo", "folder", "link-to-device"])
def test_output_non_regular_refused(tmp_path, rec, capsys, case):
    if case == "dev-null":
        path, kind = Path("/dev/null"), "a character device"
    elif case == "fifo":
        path, kind = tmp_path / "pipe", "a FIFO (named pipe)"
        os.mkfifo(path)
    elif case == "folder":
        path, kind = tmp_path / "folder", "a folder"
        path.mkdir()
    else:
        path, kind = tmp_path / "null-link", "a character device (through a symbolic link)"
        path.symlink_to("/dev/null")
    mode = os.lstat(path).st_mode
    for command, option in (("export", "--csv"), ("replay", "--screenshot")):
        code, _out, err = _cli(capsys, command, rec, option, path, "--force")
        line = _refused(code, err)
        assert line.startswith(f"kvscope: {path} is {kind}, not a regular file; refusing to write over it")
        assert os.lstat(path).st_mode == mode  # still what it was
    if case == "folder":
        assert list(path.iterdir()) == []


def test_output_dev_stdout_never_replaced(tmp_path, rec):
    """Root used to replace the system's /dev/stdout link with a regular file. Here stdout is a pipe."""
    assert os.path.islink("/dev/stdout")
    out = subprocess.run([sys.executable, str(ROOT / "main.py"), "export", str(rec), "--csv", "/dev/stdout", "--force"],
                         capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=120)
    line = _refused(out.returncode, out.stderr)
    assert line == ("kvscope: /dev/stdout is a FIFO (named pipe) (through a symbolic link), not a regular file; "
                    "refusing to write over it (use - for standard output)")
    assert out.stdout == "" and os.path.islink("/dev/stdout")


@pytest.mark.parametrize("command", ["export", "replay"])
def test_output_missing_folder_refused_not_created(tmp_path, rec, capsys, command):
    option, name = ("--csv", "x.csv") if command == "export" else ("--screenshot", "x.png")
    target = tmp_path / "no" / "such" / name
    code, out, err = _cli(capsys, command, rec, option, target)
    assert _refused(code, err) == f"kvscope: folder {target.parent} does not exist (it is not created for you)"
    assert not (tmp_path / "no").exists() and out == ""


# ------------------------------------------------------------------------------------------------
# A real `replay --screenshot` process, shared by three tests: a damaged recording, an existing PNG
# replaced with --force, and its own temp folder (TMPDIR) to look for settings files left behind.


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("replay")
    temp = folder / "temp"
    temp.mkdir()
    rec = _recording(folder, "damaged.jsonl", lines=40, damaged=(5, 8, 15))
    # What a killed --screenshot (or an older version) left behind, and the file of a running process.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left_behind = temp / f"kvscope-screenshot-{int(gone.stdout)}.ini"
    running = temp / f"kvscope-screenshot-{os.getpid()}-abc123.ini"
    for path in (left_behind, running):
        path.write_text("[app]\nfirst_start_done=true\n")
    shot = folder / "shot.png"
    shot.write_bytes(b"not a png yet")
    refused = subprocess.run([sys.executable, str(ROOT / "main.py"), "replay", str(rec), "--screenshot", str(shot)],
                             capture_output=True, text=True, cwd=folder, env=_env(TMPDIR=str(temp)), timeout=120)
    done = subprocess.run([sys.executable, str(ROOT / "main.py"), "replay", str(rec), "--speed", "1000",
                           "--screenshot", str(shot), "--force"],
                          capture_output=True, text=True, cwd=folder, env=_env(TMPDIR=str(temp)), timeout=300)
    return {"refused": refused, "done": done, "shot": shot, "temp": temp, "rec": rec, "running": running}


def test_output_screenshot_force_replaces_existing_png(replayed):
    refused, done, shot = replayed["refused"], replayed["done"], replayed["shot"]
    assert _refused(refused.returncode, refused.stderr) == f"kvscope: {shot} already exists; add --force to replace it"
    assert done.returncode == 1, done.stderr  # 1: the recording had damaged lines (it still plays)
    assert done.stdout.startswith(f"saved {shot} (")
    assert shot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_replay_damaged_lines_one_summary_line(replayed):
    err = replayed["done"].stderr
    mentions = [line for line in err.splitlines() if "damaged" in line or "skipped" in line or "line " in line]
    expected = "kvscope: recording damaged.jsonl: skipped 3 damaged lines (first: line 5: not valid JSON)"
    assert mentions == [expected], err


def test_replay_screenshot_leaves_no_settings_file(replayed):
    """Its own settings file is deleted; one a dead process left is swept; a running process's is kept."""
    assert replayed["done"].returncode == 1
    left = [p.name for p in replayed["temp"].iterdir() if p.name.startswith("kvscope-screenshot")]
    assert left == [replayed["running"].name]


# ------------------------------------------------------------------------------------------------
# Item 8


def test_sigterm_stops_run_cleanly(tmp_path):
    record = tmp_path / "run.jsonl"
    with open(tmp_path / "out.txt", "w") as out_f, open(tmp_path / "err.txt", "w") as err_f:
        child = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "run", "--device", "cpu", "--tokens", "100000",
                                  "--record", str(record)], stdout=out_f, stderr=err_f, cwd=ROOT, env=_env())
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and child.poll() is None:
                if record.exists() and record.read_bytes().count(b"\n") >= 8:  # header, load, prefill, decodes
                    break
                time.sleep(0.05)
            assert child.poll() is None, (tmp_path / "err.txt").read_text()
            child.send_signal(signal.SIGTERM)
            code = child.wait(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    out, err = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    assert code == 0, err  # as after Ctrl+C: the run ended the way it was asked to
    with RecordingReader(record) as reader:
        samples = list(reader)
        assert reader.skipped == 0 and not reader.truncated
    last = samples[-1]
    decoded = [s for s in samples if s.phase == "decode"]
    assert last.event == "stop" and last.token == decoded[-1].token and len(decoded) < 100000
    assert f"generated {last.token} tokens" in out and out.rstrip().endswith(f"recorded to {record}")
    assert "Traceback" not in err


@pytest.fixture
def no_loading(monkeypatch):
    """kvscope.core.runtimes.transformers.loading.load_model fails the test if anything tries to load a model."""
    import kvscope.core.runtimes.transformers.loading

    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(kvscope.core.runtimes.transformers.loading, "load_model", refuse)
    return calls


@pytest.mark.parametrize("case", ["record-exists", "record-dash", "record-device", "record-missing-folder",
                                  "snapshot-exists"])
def test_run_outputs_refused_before_loading(tmp_path, capsys, no_loading, case):
    existing = tmp_path / "old.jsonl"
    existing.write_text("precious\n")
    option, path, expected = {
        "record-exists": ("--record", existing, f"kvscope: cannot create recording: {existing} already exists; "
                                                "add --force to replace it"),
        "record-dash": ("--record", "-", "kvscope: cannot create recording: this output cannot go to standard "
                                         "output (-): give a file name"),
        "record-device": ("--record", "/dev/null", "kvscope: cannot create recording: /dev/null is a character "
                                                   "device, not a regular file; refusing to write over it (use - for "
                                                   "standard output)"),
        "record-missing-folder": ("--record", tmp_path / "no" / "r.jsonl",
                                  f"kvscope: cannot create recording: folder {tmp_path / 'no'} does not exist (it is "
                                  "not created for you)"),
        "snapshot-exists": ("--snapshot", existing, f"kvscope: --snapshot: {existing} already exists; add --force to "
                                                    "replace it"),
    }[case]
    code, out, err = _cli(capsys, "run", "--device", "cpu", "--tokens", "2", option, path)
    assert _refused(code, err) == expected
    assert no_loading == [] and existing.read_text() == "precious\n" and not (tmp_path / "no").exists()


def test_run_generation_refuses_record_before_loading(tmp_path, no_loading):
    """The window's runs go through run_generation, which checks before loading as well."""
    from kvscope.core.live.run import RunHooks, run_generation
    from kvscope.core.model.attention import SettingsError
    from kvscope.core.model.request import RunRequest

    existing = tmp_path / "old.jsonl"
    existing.write_text("precious\n")
    with pytest.raises(RecordingError, match=r"^cannot create recording: .*old\.jsonl already exists"):
        run_generation(RunRequest(device="cpu", max_new_tokens=2, record_path=str(existing)), RunHooks())
    with pytest.raises(SettingsError, match=r"^--snapshot: .*old\.jsonl already exists"):
        run_generation(RunRequest(device="cpu", max_new_tokens=2, snapshot_path=str(existing)), RunHooks())
    with pytest.raises(RecordingError, match=r"^cannot create recording: .* is a folder"):
        run_generation(RunRequest(device="cpu", max_new_tokens=2, record_path=str(tmp_path), overwrite=True),
                       RunHooks())
    assert no_loading == [] and existing.read_text() == "precious\n"


def test_run_record_force_replaces(tmp_path, capsys):
    existing = tmp_path / "old.jsonl"
    existing.write_text("precious\n")
    code, out, err = _cli(capsys, "run", "--device", "cpu", "--tokens", "2", "--record", existing, "--force")
    assert code == 0, err
    with RecordingReader(existing) as reader:
        assert [s.token for s in reader if s.phase == "decode"] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.jsonl"]


def test_file_names_with_control_characters_stay_on_one_line(tmp_path, capsys):
    rec = _recording(tmp_path, "dam\naged.jsonl", damaged=(5,))
    csv_path = tmp_path / "a\nb.csv"
    code, out, err = _cli(capsys, "export", rec, "--csv", csv_path)
    assert code == 0 and csv_path.exists()
    assert out.splitlines() == [f"wrote 39 samples to {display_path(csv_path)}"] and "\\n" in out
    assert err.splitlines() == ["kvscope: recording 'dam\\naged.jsonl': skipped 1 damaged line (first: line 5: "
                                "not valid JSON)"]
    code, out, err = _cli(capsys, "export", rec, "--csv", csv_path)
    assert _refused(code, err) == f"kvscope: {str(csv_path)!r} already exists; add --force to replace it"
    # Printable names, spaces and non-ASCII letters included, are shown as they are.
    assert display_path("/tmp/my run ü.csv") == "/tmp/my run ü.csv"
    assert display_path("x\x1b[31m.csv") == "'x\\x1b[31m.csv'"


CHILD_BUILD = r"""
import sys, time
from pathlib import Path
import kvscope.core.model.embedded as embedded

def stuck(folder, **kwargs):  # a first build that is killed half-way: half a weights file, then SIGKILL
    (Path(folder) / "model.safetensors").write_bytes(b"half")
    print("building", flush=True)
    time.sleep(600)

embedded.build_into = stuck
embedded.embedded_model_dir()
"""


def test_embedded_stale_build_folders_removed(tmp_path, monkeypatch):
    import socket

    from kvscope.core.model import embedded

    cache = tmp_path / "cache"
    child = subprocess.Popen([sys.executable, "-c", CHILD_BUILD], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env=_env(KVSCOPE_CACHE=str(cache)))
    try:
        assert child.stdout.readline().strip() == "building"
    finally:
        child.kill()
        child.wait(timeout=30)
    root = cache / "embedded"
    killed = [p for p in root.iterdir() if p.name.startswith(".build-")]
    assert len(killed) == 1 and killed[0].name.startswith(f".build-{child.pid}@")  # what a kill leaves behind
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"
    live = root / f".build-{os.getpid()}@{host}-live"  # a build of a running process: kept
    young = root / ".build-young"  # no owner in its name, recent: kept (it may be building)
    old = root / ".build-old"  # no owner, older than STALE_BUILD_S: removed
    for folder in (live, young, old):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))

    monkeypatch.setenv("KVSCOPE_CACHE", str(cache))
    built = embedded.embedded_model_dir()
    assert built.parent == root and embedded._is_complete(built)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".build-")) == sorted([live.name, young.name])


@pytest.mark.parametrize("case", ["below-weights", "room-for-some"])
def test_budget_messages_name_the_refused_token(case):
    from kvscope.core.live.run import BudgetExceeded, RunHooks, run_generation
    from kvscope.core.model.request import RunRequest

    weights = 13_706_368  # the embedded model's fp32 weights (checked below against the load event)
    budget = 1 << 20 if case == "below-weights" else weights + 350_000
    seen = []
    with pytest.raises(BudgetExceeded) as caught:
        run_generation(RunRequest(device="cpu", max_new_tokens=500, memory_budget=budget), RunHooks(emit=seen.append))
    assert seen[0].event == "load" and seen[0].weights_bytes == weights
    forecast = next(s for s in seen if s.event == "forecast")
    stop = next(s for s in seen if s.event == "budget")
    decoded = [s.token for s in seen if s.phase == "decode"]
    made = decoded[-1] if decoded else 0
    assert decoded == list(range(1, made + 1)) and stop.token == made
    refused = made + 1  # the token the budget stopped: the next one, counted like Sample.token
    if case == "below-weights":
        assert made == 0
    else:
        assert made >= 5
    hb = re.escape(human_bytes(budget))
    assert forecast.text == f"memory budget {human_bytes(budget)} forecast to be reached at token {refused}"
    plural = "" if made == 1 else "s"
    assert re.fullmatch(rf"memory budget {hb} reached at token {refused}, which would need [0-9.]+ [KMG]?i?B; "
                        rf"stopped after {made} generated token{plural}; the forecast said token {refused}",
                        stop.text), stop.text
    assert str(caught.value) == stop.text
