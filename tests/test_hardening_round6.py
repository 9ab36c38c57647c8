"""Hardening, round 6 (issue 38's last open cases): a stopped llama.cpp child, and what is left of calc's
impossible inputs. Real processes, real signals, the real command line."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvscope.core.base.process_state import is_stopped

REPO = Path(__file__).resolve().parent.parent


def test_a_stopped_process_is_told_from_a_running_one_and_a_gone_one():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert not is_stopped(child.pid)
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not is_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert is_stopped(child.pid)
        child.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 5
        while is_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not is_stopped(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not is_stopped(child.pid) and not is_stopped(None)


def test_a_stopped_llamacpp_child_ends_the_run_in_one_line_and_keeps_the_recording(tmp_path):
    pytest.importorskip("llama_cpp", reason="the llamacpp extra (make test installs it)")
    from kvscope.core.base.errors import RuntimeCrashed
    from kvscope.core.live.run import run_generation
    from kvscope.core.model.request import RunHooks, RunRequest
    from kvscope.core.prediction.llamacpp import LlamaCppOptions
    from kvscope.core.records.recording import RecordingReader
    from kvscope.core.runtimes.llamacpp import runtime as llamacpp_runtime

    record = tmp_path / "stopped.jsonl"
    before = {p.pid for p in psutil.Process().children()}
    samples, stopped_at = [], []

    def emit(sample):
        samples.append(sample)
        if sample.phase == "decode" and sample.token == 3:  # the child stops now (kill -STOP, a debugger)
            for child in psutil.Process().children():  # llama.cpp's child, not multiprocessing's resource tracker
                if child.pid not in before and "spawn_main" in " ".join(child.cmdline()):
                    child.send_signal(signal.SIGSTOP)
            stopped_at.append(time.monotonic())

    with pytest.raises(RuntimeCrashed, match=r"stopped \(SIGSTOP\) for 5 s, so KV Scope ended it, at token 3") as info:
        run_generation(RunRequest(runtime="llama.cpp", options={"llama.cpp": LlamaCppOptions(n_ctx=512)},
                                  max_new_tokens=20, record_path=str(record)), RunHooks(emit=emit))
    waited = time.monotonic() - stopped_at[0]
    assert llamacpp_runtime.STOPPED_S <= waited < llamacpp_runtime.STOPPED_S + 10, waited
    assert "\n" not in str(info.value)
    with RecordingReader(record) as reader:
        back = list(reader)
    assert back == samples and back[-1].event == "error" and back[-1].token == 3 and "SIGSTOP" in back[-1].text
    assert not [p for p in psutil.Process().children() if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE
                and "spawn_main" in " ".join(p.cmdline())]  # the stopped child was ended, not left behind


# ---------------------------------------------------------------------------------------------------- calc


def _calc(capsys, *args: str) -> tuple[int, str, str]:
    from kvscope import main

    code = main.main(["calc", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("max_context, contexts", [("16", "4096"), ("4k", "2k,8k")])
def test_calc_refuses_a_static_cache_smaller_than_the_context(capsys, max_context, contexts):
    from tests.helpers import one_line_error

    line = one_line_error(*_calc(capsys, "--model", "llama-3-8b", "--cache", "static", "--max-context", max_context,
                                 "--context", contexts)[::2])
    largest = max(int(c.replace("k", "")) * (1024 if "k" in c else 1) for c in contexts.split(","))
    assert f"cannot hold a context of {largest:,}" in line and "--max-context" in line


def test_calc_still_answers_a_static_cache_that_holds_the_context(capsys):
    code, out, err = _calc(capsys, "--model", "llama-3-8b", "--cache", "static", "--max-context", "8k", "--context",
                           "4k,8k")
    assert code == 0 and "8,192" in out, err


def test_calc_says_when_the_largest_context_is_the_searchs_own_limit(capsys):
    from kvscope.core.prediction.calc import SEARCH_LIMIT

    code, out, err = _calc(capsys, "--model", "embedded", "--gpu-memory", "10000GiB")
    assert code == 0, err
    assert f"{SEARCH_LIMIT:,} tokens or more (the search stops there)" in out
    code, out, err = _calc(capsys, "--model", "embedded", "--gpu-memory", "1GiB")  # an answer below it: plain
    assert code == 0 and "Largest context that fits" in out and "or more" not in out, err


@pytest.mark.parametrize("key, value", [("torch_dtype", "int4"), ("torch_dtype", "int8"), ("dtype", "q2")])
def test_calc_refuses_weights_in_an_integer_dtype(capsys, tmp_path, key, value):
    import json

    from tests.helpers import one_line_error
    from tests.real_models import smollm2_folder

    config = json.loads((smollm2_folder() / "config.json").read_text())
    config.pop("torch_dtype", None), config.pop("dtype", None)
    config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    line = one_line_error(*_calc(capsys, "--model", str(tmp_path / "config.json"))[::2])
    assert f"{key} {value!r} is not a dtype weights load in" in line


def _lying_gguf(path: Path, key: bytes, value: int) -> Path:
    """The tiny llama GGUF with one uint32 of its header changed: KV Scope's header reader takes it, llama.cpp's loader
    does not."""
    import struct

    from tests import gguf_models

    data = bytearray(gguf_models.llama(path.with_name("honest.gguf")).read_bytes())
    at = data.index(key) + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 4  # GGUF's uint32 type
    struct.pack_into("<I", data, at + 4, value)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("key, value, reason", [(b"llama.block_count", 3, "tensor 'blk.2.attn_norm.weight' not found"),
                                                (b"llama.embedding_length", 256, "invalid n_rot")])
def test_calc_refuses_a_gguf_llamacpp_refuses_at_load(capsys, tmp_path, key, value, reason):
    pytest.importorskip("llama_cpp", reason="the llamacpp extra (make test installs it)")
    from tests.helpers import one_line_error

    path = _lying_gguf(tmp_path / "lie.gguf", key, value)
    line = one_line_error(*_calc(capsys, "--model", str(path), "--runtime", "llama.cpp", "--context", "512")[::2])
    assert "llama.cpp could not load it" in line and reason in line and "no figure for it" in line
    code, out, err = _calc(capsys, "--model", str(path.with_name("honest.gguf")), "--runtime", "llama.cpp",
                           "--context", "512")
    assert code == 0 and "dry run" in out, err  # the honest file still gets its figures


def test_no_proc_leaves_this_process_memory_not_available_instead_of_a_traceback():
    """A chroot without /proc (issue 38: the self-test ended in psutil.NoSuchProcess): the probe reads, RSS None."""
    import shutil

    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    probe = ("from kvscope.core.runtimes.probes import MemoryProbe; r = MemoryProbe(device='cpu').read(); "
             "print('rss', r.process_rss)")
    script = f"mount -t tmpfs none /proc && exec {sys.executable} -c \"{probe}\""
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        pytest.skip("unshare is not permitted here (not root)")
    assert done.returncode == 0 and done.stdout.split()[-2:] == ["rss", "None"], done.stderr[-2000:]


@pytest.mark.parametrize("edit, named", [({"intermediate_size": 10**12}, "intermediate_size 1,000,000,000,000"),
                                         ({"num_attention_heads": 2**31}, "num_attention_heads 2,147,483,648"),
                                         ({"text_config": {"hidden_size": 2**40}}, "text_config.hidden_size")])
def test_mlx_refuses_sizes_its_arrays_cannot_take(tmp_path, edit, named):
    """intermediate_size 1e12 was mlx-lm's 'OverflowError: Integer value ... is outside the supported range'."""
    import json

    from kvscope.core.model.spec import SettingsError
    from kvscope.core.runtimes.mlx.load import resolve_model
    from tests.real_models import smollm2_folder

    real = smollm2_folder()
    for file in real.iterdir():
        if file.name != "config.json":
            (tmp_path / file.name).symlink_to(file)
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((real / "config.json").read_text()), **edit}))
    with pytest.raises(SettingsError) as refused:
        resolve_model(str(tmp_path))
    assert named in str(refused.value) and "more than MLX's arrays take" in str(refused.value)
    assert resolve_model(str(real)) == real  # the real folder's sizes pass
