"""llama.cpp cannot take the app down (issue 29 item 2): the real llama.cpp runs in a child process in every mode.

A GGUF KV Scope reads but llama.cpp aborts on (a vocabulary with one token twice: llama-vocab.cpp's
GGML_ASSERT(id_to_token.size() == token_to_id.size()) -> SIGABRT) and an abort in the middle of a run (the child
sent SIGABRT after token 3) end as an ``error`` event in the recording, one line and exit 2 on the command line,
and one line in the window, which stays up and runs llama.cpp again.
"""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import pytest

pytest.importorskip("llama_cpp", reason="the llamacpp extra (make test installs it)")

from kvscope.core.base.errors import RuntimeCrashed  # noqa: E402
from kvscope.core.live.run import run_generation  # noqa: E402
from kvscope.core.model.gguf_write import GgufVocab  # noqa: E402
from kvscope.core.model.request import RunHooks, RunRequest  # noqa: E402
from kvscope.core.prediction.llamacpp import LlamaCppOptions  # noqa: E402
from kvscope.core.records.recording import RecordingReader  # noqa: E402
from tests import gguf_models  # noqa: E402
from tests.helpers import one_line_error, run_in_window  # noqa: E402


def _duplicate_token_gguf(folder: Path) -> Path:
    """The tiny llama with token 200 spelled as token 199: KV Scope reads its header; llama.cpp aborts loading it."""
    vocab = GgufVocab.tiny(gguf_models.VOCAB)
    vocab.tokens[200] = vocab.tokens[199]
    tiny = GgufVocab.tiny
    GgufVocab.tiny = classmethod(lambda cls, size: vocab)
    try:
        return gguf_models.llama(folder / "twice.gguf")
    finally:
        GgufVocab.tiny = tiny


@pytest.fixture(scope="module")
def aborting_gguf(tmp_path_factory) -> Path:
    return _duplicate_token_gguf(tmp_path_factory.mktemp("abort"))


def test_an_abort_while_loading_is_one_line_an_error_event_and_exit_2(aborting_gguf, tmp_path, capsys):
    from kvscope import main

    record = tmp_path / "abort.jsonl"
    rc = main.main(["run", "--model", str(aborting_gguf), "--tokens", "3", "--record", str(record)])
    line = one_line_error(rc, capsys.readouterr().err)  # exit 2, one line, no traceback
    assert "llama.cpp ended with SIGABRT while loading twice.gguf" in line and "GGML_ASSERT" in line
    with RecordingReader(record) as reader:  # the recording exists, and says so
        events = list(reader)
        header = reader.header
    assert [s.event for s in events] == ["error"] and "SIGABRT" in events[0].text
    assert header["settings"]["runtime"] == "llama.cpp" and events[0].kv_bytes_predicted > 0  # the plan's


def test_an_abort_mid_run_keeps_the_samples_and_ends_with_the_error(tmp_path):
    record = tmp_path / "mid.jsonl"
    before = {p.pid for p in psutil.Process().children()}
    samples = []

    def emit(sample):
        samples.append(sample)
        if sample.phase == "decode" and sample.token == 3:  # llama.cpp aborts now, in its own process
            for child in psutil.Process().children():
                if child.pid not in before:
                    child.send_signal(signal.SIGABRT)

    with pytest.raises(RuntimeCrashed, match="llama.cpp ended with SIGABRT at token 3"):
        run_generation(RunRequest(runtime="llama.cpp", options={"llama.cpp": LlamaCppOptions(n_ctx=512)}, max_new_tokens=20,
                                  record_path=str(record)), RunHooks(emit=emit))
    with RecordingReader(record) as reader:
        back = list(reader)
    assert back == samples and back[-1].event == "error" and back[-1].token == 3
    last_decode = [s for s in back if s.phase == "decode"][-1]
    # The event carries what was known: the last sample's settings and KV figures.
    assert (back[-1].kv_bytes_reserved, back[-1].kv_bytes_held, back[-1].cache) == (
        last_decode.kv_bytes_reserved, last_decode.kv_bytes_held, last_decode.cache)
    assert not [p for p in psutil.Process().children() if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]  # no child left behind


def test_the_window_says_it_and_runs_llamacpp_again(qtbot, window, aborting_gguf):
    run_in_window(qtbot, window, RunRequest(runtime="llama.cpp", source=str(aborting_gguf), max_new_tokens=3,
                                            options={"llama.cpp": LlamaCppOptions(n_ctx=512)}))
    assert "llama.cpp ended with SIGABRT while loading twice.gguf" in window.last_error
    assert "Traceback" not in window.last_error and "\n" not in window.last_error
    run_in_window(qtbot, window, RunRequest(runtime="llama.cpp", max_new_tokens=3, options={"llama.cpp": LlamaCppOptions(n_ctx=512)}))
    assert window.last_error == "" and window.decode_tokens == 3
