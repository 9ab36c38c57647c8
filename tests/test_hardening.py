"""Issue 7, hardening: every named case of bad input, fault, shutdown and churn, one test each.

Everything here drives the real code: the CLI (``main.main([...])`` in-process; a real child
process where its exit status and stderr are the point), the Engine and run_generation on the
embedded demo model and tiny real models saved with save_pretrained, the window and its generation
worker through pytest-qt (offscreen), real recording files. Faked, and only at their boundary:
NVML (tests/fake_pynvml.py, in place of the pynvml module), the hub's refusals (huggingface_hub's
own GatedRepoError / RepositoryNotFoundError raised from transformers' call to hf_hub_download,
as there is no network here), and out-of-memory (the model's forward raises
torch.OutOfMemoryError at a chosen call, as CUDA's allocator would).

Case -> test (all in this file)

Model source (through ``main.py run --model``: exit 2, one line on stderr, no traceback, the
embedded model offered)
  unknown hub id, no network, gated repo, local folder with no config, not a causal LM (BERT),
  code from the hub without opt-in, pickle-only weights without opt-in, weights that do not match
  their config .............................. test_model_source_refused[<case>]
  the real process for an unknown hub id .... test_model_source_unknown_hub_id_real_process
  remote code / pickle with the opt-in ...... test_model_source_opt_ins_load
Settings
  GQA group count not dividing the heads .... test_settings_gqa_group_count_not_dividing_heads
  context beyond the model's maximum ........ test_settings_context_beyond_model_maximum_calc,
                                              test_settings_max_context_beyond_model_maximum_run
  window larger than the context ............ test_settings_window_larger_than_context
  quantized cache on a sliding-window model . test_settings_quantized_cache_on_sliding_window[<case>]
  offloaded cache without CUDA .............. test_settings_offloaded_cache_without_cuda
  fp16 on a device that cannot run it ....... test_settings_device_without_support_for_fp16,
                                              test_settings_fp16_on_cpu_is_allowed_and_halves_memory
Runtime faults
  out of memory in prefill / in decode ...... test_runtime_out_of_memory_is_recovered[prefill|decode]
  ... and the window stays usable ........... test_runtime_out_of_memory_window_stays_usable
  NVML missing / failing mid-run ............ test_runtime_nvml_missing_or_failing[<case>]
  worker raising mid-token .................. test_runtime_worker_raising_mid_token,
                                              test_runtime_worker_raising_mid_token_window_controls_come_back
Files
  truncated / corrupted / empty / unknown-version / newer-version recordings
                                              test_files_damaged_recording_export[<case>]
  replay of a broken recording (real process) test_files_replay_broken_recording_real_process
  a very large recording, streamed .......... test_files_large_recording_export_streams
  calculator config with missing or absurd fields
                                              test_files_calculator_bad_config[<case>]
Shutdown and churn
  closing the window mid-generation ......... test_shutdown_close_window_mid_generation
  200 rapid attention-mode switches ......... test_churn_200_attention_switches_exact_cache_bytes
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from transformers import (BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

from kvscope import main
from kvscope.core.live.run import RunHooks, run_generation
from kvscope.core.model.attention import MHA, SettingsError, Window, parse_attention
from kvscope.core.model.caches import Static
from kvscope.core.model.embedded import embedded_model_dir
from kvscope.core.model.request import RunRequest
from kvscope.core.model.settings import RunSettings
from kvscope.core.prediction.predict import kv_bytes
from kvscope.core.records.recording import RecordingReader, RecordingWriter
from kvscope.core.runtimes.probes import NOTE_NO_NVML, MemoryProbe
from kvscope.core.runtimes.transformers import loading
from kvscope.core.runtimes.transformers.engine import Engine
from kvscope.core.runtimes.transformers.loading import EMBEDDED_HINT, load_model
from kvscope.core.runtimes.transformers.measure import cache_bytes
from tests.fake_pynvml import NVML_ERROR_GPU_IS_LOST, FakeGpu, FakeNvml
from tests.helpers import (hub_offline, one_line_error, os_thread_names,  # noqa: F401 - hub_offline: a fixture
                           run_args, run_in_window)

pytestmark = pytest.mark.usefixtures("hub_offline")

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
GiB = 1 << 30


# ------------------------------------------------------------------------------------------------
# Shared helpers and fixtures


@pytest.fixture(scope="module")
def embedded_dir() -> Path:
    return embedded_model_dir()


def _save(model, folder: Path, embedded_dir: Path) -> Path:
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:  # the embedded model's byte-level tokenizer (vocab 1024)
        shutil.copy(embedded_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory, embedded_dir) -> Path:
    """Tiny real model folders (random init, seed 0), one per model-source case, built once."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    llama = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256)
    tiny = _save(LlamaForCausalLM(llama), root / "tiny-llama", embedded_dir)

    (root / "no-config").mkdir()
    shutil.copy(tiny / "model.safetensors", root / "no-config" / "model.safetensors")

    bert = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100)
    BertForMaskedLM(bert).save_pretrained(root / "tiny-bert")
    (root / "tiny-bert" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdef"]))

    remote = shutil.copytree(tiny, root / "remote-code")
    (remote / "configuration_kvscope_remote.py").write_text(REMOTE_CONFIG_PY.format(marker=str(root / "remote-ran")))
    (remote / "modeling_kvscope_remote.py").write_text(REMOTE_MODELING_PY)
    cfg = json.loads((remote / "config.json").read_text())
    cfg.update(model_type="kvscope-remote-test", architectures=["KvscopeRemoteForCausalLM"], auto_map={
        "AutoConfig": "configuration_kvscope_remote.KvscopeRemoteConfig",
        "AutoModelForCausalLM": "modeling_kvscope_remote.KvscopeRemoteForCausalLM"})
    (remote / "config.json").write_text(json.dumps(cfg))

    pickled = root / "pickle-only"
    pickled.mkdir()
    shutil.copy(tiny / "config.json", pickled / "config.json")
    torch.save(LlamaForCausalLM.from_pretrained(tiny).state_dict(), pickled / "pytorch_model.bin")
    for name in TOKENIZER_FILES:
        shutil.copy(tiny / name, pickled / name)

    mismatch = shutil.copytree(tiny, root / "mismatch")
    cfg = json.loads((mismatch / "config.json").read_text())
    cfg["intermediate_size"] = 96  # the stored MLP weights are 128 wide
    (mismatch / "config.json").write_text(json.dumps(cfg))

    # Sliding-window models: Mistral-like (every layer slides) and Qwen2 with full and sliding layers.
    # head_dim 64 so that quanto's groups of 64 fit (the refusal must be about the window, nothing else).
    _save(MistralForCausalLM(MistralConfig(hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                                           max_position_embeddings=256, sliding_window=32)),
          root / "tiny-mistral", embedded_dir)
    _save(Qwen2ForCausalLM(Qwen2Config(hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                                       max_position_embeddings=256, use_sliding_window=True, sliding_window=32,
                                       max_window_layers=1)),
          root / "tiny-qwen2-mixed", embedded_dir)
    return root


REMOTE_CONFIG_PY = '''
from pathlib import Path
from transformers import LlamaConfig

Path({marker!r}).write_text("ran")  # leaves a mark: the test can tell whether this code ran


class KvscopeRemoteConfig(LlamaConfig):
    model_type = "kvscope-remote-test"
'''
REMOTE_MODELING_PY = '''
from transformers import LlamaForCausalLM
from .configuration_kvscope_remote import KvscopeRemoteConfig


class KvscopeRemoteForCausalLM(LlamaForCausalLM):
    config_class = KvscopeRemoteConfig
'''


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``main.main(argv)`` in this process; returns (exit status, stdout, stderr)."""
    code = main.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _hub_refuses(monkeypatch, error_name: str, status: int) -> None:
    """Make transformers' download call raise what the hub raises for this status (no network here)."""
    import httpx2  # huggingface_hub's HTTP client: its errors carry the response
    from huggingface_hub import errors
    from transformers.utils import hub

    error_cls = getattr(errors, error_name)

    def refuse(repo_id, filename, **_kwargs):
        request = httpx2.Request("GET", f"https://huggingface.co/{repo_id}/resolve/main/{filename}")
        raise error_cls(f"{status} Client Error for {repo_id}", response=httpx2.Response(status, request=request))

    monkeypatch.setattr(hub, "hf_hub_download", refuse)


def _fail_forward(monkeypatch, call: int, make_error, loads: tuple[int, ...] = (1,)) -> dict:
    """Every model run_generation loads (the real load_model) gets a forward that raises
    ``make_error()`` at its ``call``-th call (1 = the prefill, 2 = the prefill's profiled trial pass that
    measures the kernel, k + 2 = token k), for the
    ``loads``-th loads only (1-based), so a later run in the same test works normally."""
    real_load = loading.load_model
    state = {"loads": 0}

    def load(*args, **kwargs):
        lm = real_load(*args, **kwargs)
        state["loads"] += 1
        if state["loads"] not in loads:
            return lm
        forward = lm.model.forward
        calls = {"n": 0}

        def failing(*f_args, **f_kwargs):
            calls["n"] += 1
            if calls["n"] == call:
                raise make_error()
            return forward(*f_args, **f_kwargs)

        lm.model.forward = failing
        return lm

    monkeypatch.setattr(loading, "load_model", load)  # run_generation imports it at call time
    return state


def _oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 23.65 GiB total capacity)")


def _os_threads(prefix: str = "kvscope-") -> list[str]:
    """This process's OS threads whose names start with ``prefix`` (Linux cuts names to 15 characters)."""
    return [n for n in os_thread_names() if n.startswith(prefix[:15])]


# ================================================================================================
# Model source


MODEL_SOURCE_CASES = {
    # case: (source (a name under the models folder, or a hub id), extra args, what the line says)
    "unknown-hub-id": ("no-such-org/no-such-model", (), "no-such-org/no-such-model: no such model on the Hugging Face hub"),
    "no-network": ("some-org/not-cached-model", (), "not in the local Hugging Face cache, and the hub cannot be reached"),
    "gated-repo": ("meta-llama/Llama-3-gated", (), "meta-llama/Llama-3-gated is gated: accept its licence"),
    "folder-without-config": ("no-config", (), "has no config.json"),
    "encoder-not-causal-lm": ("tiny-bert", (), "tiny-bert is BertForMaskedLM, not a causal language model: an encoder"),
    "remote-code-without-opt-in": ("remote-code", (), "needs Python code from the model's own repository"),
    "pickle-weights-without-opt-in": ("pickle-only", (), "weights only in pickle format (pytorch_model.bin)"),
    "weights-do-not-match-config": ("mismatch", (),
                                    "the weights do not match config.json - some tensors have other shapes"),
}


@pytest.mark.parametrize("case", list(MODEL_SOURCE_CASES))
def test_model_source_refused(case, models, capsys, monkeypatch):
    """Each bad source: `main.py run --model SRC` exits 2 with one specific line that offers the embedded model.

    Unknown and gated repos need the hub to answer; here (no network) huggingface_hub's own
    RepositoryNotFoundError (404) / GatedRepoError (403) are raised where transformers downloads,
    and everything above that boundary is the real path. "No network" is the real offline path
    (HF_HUB_OFFLINE=1): a hub id not in the local cache.
    """
    source, extra, expected = MODEL_SOURCE_CASES[case]
    if case == "unknown-hub-id":
        _hub_refuses(monkeypatch, "RepositoryNotFoundError", 404)
    elif case == "gated-repo":
        _hub_refuses(monkeypatch, "GatedRepoError", 403)
    if "/" not in source:
        source = str(models / source)
    line = one_line_error(*_cli(capsys, *run_args(source, *extra))[::2])
    assert expected in line
    assert line.endswith(EMBEDDED_HINT)
    if case == "remote-code-without-opt-in":
        assert "--trust-remote-code" in line and "is not part of transformers" in line  # says why
        assert not (models / "remote-ran").exists()  # the repository's code never ran
    if case == "pickle-weights-without-opt-in":
        assert "unpickling can run arbitrary code" in line and "--allow-pickle" in line
    if case == "weights-do-not-match-config":
        assert "mlp.down_proj.weight is [64, 128] in the weights, [64, 96] by the config" in line


def test_model_source_unknown_hub_id_real_process():
    """The issue's example as a real process: `python main.py run --model no-such-org/no-such-model`."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("KVSCOPE_DEBUG", None)
    out = subprocess.run([sys.executable, str(ROOT / "main.py"), "run", "--model", "no-such-org/no-such-model",
                          "--device", "cpu"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    line = one_line_error(out.returncode, out.stderr)
    assert line.startswith("kvscope: no-such-org/no-such-model: ") and line.endswith(EMBEDDED_HINT)
    assert out.stdout == ""


def test_model_source_opt_ins_load(models, capsys, monkeypatch, tmp_path):
    """The refusals above are opt-outs, not dead ends: --trust-remote-code and --allow-pickle load and run."""
    # The repository code goes to HF_MODULES_CACHE (one folder per session, see tests/conftest.py).
    monkeypatch.setattr(sys, "path", list(sys.path))
    code, out, err = _cli(capsys, *run_args(str(models / "remote-code"), "--trust-remote-code"))
    assert code == 0, err
    assert (models / "remote-ran").read_text() == "ran"
    assert "observed == predicted at 3 of 3 samples" in out
    code, out, err = _cli(capsys, *run_args(str(models / "pickle-only"), "--allow-pickle"))
    assert code == 0, err
    assert "observed == predicted at 3 of 3 samples" in out


# ================================================================================================
# Settings


def test_settings_gqa_group_count_not_dividing_heads(capsys):
    """`run --attention gqa:3` (8 query heads) and the same in the calculator: one line naming the choices."""
    line = one_line_error(*_cli(capsys, *run_args("embedded", "--attention", "gqa:3"))[::2])
    assert line == ("kvscope: gqa:3 does not divide 8 query heads of embedded demo model; "
                    "choose one of gqa:1, gqa:2, gqa:4, gqa:8")
    calc_line = one_line_error(*_cli(capsys, "calc", "--attention", "gqa:3")[::2])
    assert calc_line == line


def test_settings_refused_before_the_weights_load(monkeypatch):
    """The same refusal comes before any weights load (the window shows it at once, not after a load)."""
    def load(*args, **kwargs):
        raise AssertionError("weights were loaded for settings the model cannot take")

    monkeypatch.setattr(loading, "load_model", load)
    request = RunRequest(device="cpu", settings=RunSettings(attention=parse_attention("gqa:3")))
    with pytest.raises(SettingsError, match=r"^gqa:3 does not divide 8 query heads"):
        run_generation(request, RunHooks())


def test_settings_context_beyond_model_maximum_calc(capsys):
    """calc answers beyond the trained maximum (4,096 for the embedded model) but marks every such row."""
    code, out, err = _cli(capsys, "calc", "--context", "4k,8k,16k", "--gpu-memory", "64GiB")
    assert code == 0, err
    rows = [line.split()[0] for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert rows == ["4,096", "8,192*", "16,384*"]
    assert "* beyond the model's trained maximum of 4,096 tokens" in out
    assert "(beyond the model's trained maximum of 4,096)" in out  # the "largest context that fits" line


def test_settings_max_context_beyond_model_maximum_run(capsys, tmp_path):
    """`run --cache static --max-context 100000` on a 4,096-token model: clamped to 4,096 with a note.

    Clamped rather than refused because the window remembers its max-context across models; a static
    cache preallocated beyond the trained positions would only hold memory no token can use. The
    note is an event in the stream (terminal line, recording), and the static cache holds exactly
    4,096 positions, as predicted.
    """
    record = tmp_path / "clamped.jsonl"
    code, out, err = _cli(capsys, *run_args("embedded", "--cache", "static", "--max-context", "100000",
                                             "--record", str(record)))
    assert code == 0, err
    assert ("-- [note] token 0: max context 100,000 is beyond embedded demo model's maximum of "
            "4,096 tokens (max_position_embeddings): using 4,096") in out
    with RecordingReader(record) as reader:
        samples = list(reader)
        assert reader.settings["max_context"] == 4096
    spec = load_model("embedded", device="cpu").spec
    static_4k = kv_bytes(spec, RunSettings(cache=Static(), max_context=4096), 1)
    tokens = [s for s in samples if s.phase != "event"]
    assert len(tokens) == 3
    assert all(s.kv_bytes_reserved == s.kv_bytes_predicted == static_4k == 4096 * 8192 for s in tokens)
    assert [s.event for s in samples if s.phase == "event"] == ["load", "note"]


def test_settings_window_larger_than_context():
    """window:100000 on a run of ~40 tokens: allowed, a note says the cache keeps every token, and the
    engine and the predictor agree that it holds exactly what full attention (MHA) holds."""
    seen = []
    request = RunRequest(device="cpu", max_new_tokens=6, settings=RunSettings(attention=Window(100_000)))
    run_generation(request, RunHooks(emit=seen.append))
    notes = [s.text for s in seen if s.event == "note"]
    assert len(notes) == 1 and notes[0].startswith("window:100000 is larger than this run's context (")
    assert "the same bytes as full attention" in notes[0]
    spec = load_model("embedded", device="cpu").spec
    tokens = [s for s in seen if s.phase != "event"]
    assert len(tokens) == 7 and all(s.attention == "window:100000" for s in tokens)
    for s in tokens:
        full = kv_bytes(spec, RunSettings(attention=MHA()), s.context_tokens)
        assert s.kv_bytes_reserved == s.kv_bytes_predicted == full, s.token


@pytest.mark.parametrize("case", ["window-mode-on-a-full-attention-model", "mistral-like-all-layers-slide",
                                  "qwen2-some-layers-slide", "qwen2-some-layers-slide-live-switch"])
def test_settings_quantized_cache_on_sliding_window(case, models, capsys):
    """transformers' QuantizedCache refuses sliding layers; KV Scope says so in one line, before any token,
    and a live switch to it is a refused event that leaves the run going (it used to be a ValueError
    from QuantizedCache that ended the run as an internal error)."""
    if case.endswith("live-switch"):
        engine = Engine(load_model(str(models / "tiny-qwen2-mixed"), device="cpu"), RunSettings(), seed=0)
        engine.prefill(torch.tensor([[5, 6, 7, 8]]), "p")
        with pytest.raises(SettingsError, match=r"quantized cache needs full-attention layers; transformers refuses "
                                                r"it with a sliding window \(1 of 2 layers of tiny-qwen2-mixed slide\)"):
            engine.apply("cache", "quantized:4")
        assert engine.settings.cache.key == "dynamic"
        s = engine.step()
        assert s.cache == "dynamic" and s.kv_bytes_reserved == s.kv_bytes_predicted
        return
    model, extra = {
        "window-mode-on-a-full-attention-model": ("embedded", ("--attention", "window:16")),
        "mistral-like-all-layers-slide": (str(models / "tiny-mistral"), ()),
        "qwen2-some-layers-slide": (str(models / "tiny-qwen2-mixed"), ()),
    }[case]
    code, out, err = _cli(capsys, *run_args(model, "--cache", "quantized:4", *extra))
    line = one_line_error(code, err)
    assert "a quantized cache needs full-attention layers; transformers refuses it with a sliding window" in line
    assert "prefill" not in out  # refused before the first token


def test_settings_offloaded_cache_without_cuda(capsys):
    """`--cache offloaded` needs CUDA; here there is none (on a CUDA machine the strategy is accepted)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the offloaded cache is allowed")
    line = one_line_error(*_cli(capsys, "run", "--cache", "offloaded", "--tokens", "2")[::2])
    assert line == ("kvscope: the offloaded cache needs CUDA (this run is on cpu): it moves layers between GPU "
                    "and CPU memory")


def test_settings_device_without_support_for_fp16(capsys):
    """`--dtype fp16 --device mps` here (no Apple GPU): the device is refused first, saying why, and the
    embedded model is not offered (it would fail the same way). bf16 on a pre-Ampere CUDA GPU is refused by
    kvscope.core.runtimes.transformers.loading.resolve_dtype ("bf16 is not supported on <GPU> (compute capability x.y; bf16 needs 8.0)");
    no such GPU here, so that message is covered in tests/test_loading.py's resolve_dtype tests only."""
    if torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    line = one_line_error(*_cli(capsys, *run_args("embedded", "--dtype", "fp16", "--device", "mps"))[::2])
    assert line.startswith("kvscope: device mps is not available: ")
    assert EMBEDDED_HINT not in line
    line = one_line_error(*_cli(capsys, *run_args("embedded", "--dtype", "fp12"))[::2])
    assert line.startswith("kvscope: unknown dtype 'fp12'; use ") and "fp16" in line


def test_settings_fp16_on_cpu_is_allowed_and_halves_memory(capsys):
    """fp16 on the CPU is allowed (documented in kvscope.core.runtimes.transformers.loading: slow, but it shows the memory halve):
    the run works and its KV cache is exactly half the fp32 one, as predicted."""
    code16, out16, err = _cli(capsys, *run_args("embedded", "--dtype", "fp16"))
    assert code16 == 0, err
    code32, out32, err = _cli(capsys, *run_args("embedded"))
    assert code32 == 0, err

    def kv(out: str) -> int:
        line = next(line for line in out.splitlines() if line.startswith("KV cache: observed"))
        return int(line.split("(")[1].split(" B)")[0].replace(",", ""))

    assert "dtype float16" in out16 and "observed == predicted at 3 of 3 samples" in out16
    assert kv(out16) * 2 == kv(out32)


# ================================================================================================
# Runtime faults


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_runtime_out_of_memory_is_recovered(where, capsys, monkeypatch, tmp_path):
    """Out of memory in the prefill or at token 5: `run` exits 2 with one line, the cache is freed (the
    oom event observes 0 KV bytes), and the recording holds every sample up to the oom event, intact.

    A real CUDA out-of-memory cannot be produced here; torch raises torch.OutOfMemoryError from the
    allocator inside the model's forward, which is exactly where this test raises it. On CUDA the
    engine's free_cache also returns the cached blocks to the driver (torch.cuda.empty_cache).
    """
    _fail_forward(monkeypatch, call=1 if where == "prefill" else 7, make_error=_oom)
    record = tmp_path / "oom.jsonl"
    code, out, err = _cli(capsys, "run", "--device", "cpu", "--tokens", "20", "--record", str(record))
    line = one_line_error(code, err)
    expected = "out of memory in prefill" if where == "prefill" else "out of memory in decode at token 5"
    assert line.startswith(f"kvscope: {expected} (CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "cache freed" in line and "The predictor had said KV" in line
    with RecordingReader(record) as reader:
        samples = list(reader)
        assert reader.skipped == 0 and not reader.truncated
    assert samples[-1].event == "oom" and samples[-1].text == line.removeprefix("kvscope: ")
    assert samples[-1].kv_bytes_reserved == 0  # the cache was dropped before the event was measured
    decoded = [s for s in samples if s.phase == "decode"]
    assert len(decoded) == (0 if where == "prefill" else 4)
    assert all(s.kv_bytes_reserved == s.kv_bytes_predicted for s in decoded)
    assert f"-- [oom] token {len(decoded)}:" in out


def test_runtime_out_of_memory_window_stays_usable(qtbot, thread_window, monkeypatch):
    """OOM at token 3 in the window: the message is shown, the controls come back, the next run works.
    (Thread mode: the patched model must run in this process.)"""
    window = thread_window
    _fail_forward(monkeypatch, call=5, make_error=_oom, loads=(1,))
    run_in_window(qtbot, window, RunRequest(device="cpu", max_new_tokens=50))
    assert window.last_error.startswith("out of memory in decode at token 3")
    assert window.controls.error_label.text() == window.last_error
    assert window.state == "idle" and window.controls.start_button.isEnabled() and not window.controls.stop_button.isEnabled()
    assert not window.controller.is_running()
    assert window.decode_tokens == 2
    # The next run also carries a "note" event (max context clamped to the model's 4,096): the window takes it.
    run_in_window(qtbot, window, RunRequest(device="cpu", max_new_tokens=8,
                                             settings=RunSettings(cache=Static(), max_context=100_000)))
    assert window.last_error == "" and window.controls.error_label.text() == ""
    assert window.decode_tokens == 8 and window.controls.start_button.isEnabled()


@pytest.mark.parametrize("case", ["nvml-missing", "nvml-library-not-loadable", "nvml-failing-mid-run"])
def test_runtime_nvml_missing_or_failing(case, monkeypatch):
    """NVML absent, or failing mid-run (the GPU "is lost"): the engine keeps generating; every NVML
    figure is None (never 0) with a note saying why, and resumes nothing it cannot read.

    The engine here runs on the CPU with a probe for "cuda:0" (there is no GPU): the probe's NVML
    path is the one a CUDA run takes. "nvml-missing": the pynvml module cannot be imported.
    "nvml-library-not-loadable": the real pynvml, whose nvmlInit fails without a driver (on a
    machine with a driver the fake stands in). "nvml-failing-mid-run": the fake, working for three
    tokens, then raising NVML_ERROR_GPU_IS_LOST on every call.
    """
    fake = FakeNvml([FakeGpu(total=24 * GiB, used=5 * GiB, reserved=GiB // 4, compute=[(os.getpid(), GiB)])])
    if case == "nvml-missing":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
        probe = MemoryProbe("cuda:0")
    elif case == "nvml-library-not-loadable":
        import pynvml

        try:
            pynvml.nvmlInit()
            pynvml.nvmlShutdown()
            pytest.skip("this machine has a working NVML")
        except pynvml.NVMLError:
            probe = MemoryProbe("cuda:0")
    else:
        probe = MemoryProbe("cuda:0", nvml=fake)
    engine = Engine(load_model("embedded", device="cpu"), RunSettings(), probe=probe, seed=0)
    ids = torch.randint(3, engine.spec.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    samples = [engine.prefill(ids, "p")]
    for k in range(1, 9):
        if k == 4 and case == "nvml-failing-mid-run":
            fake.fail = NVML_ERROR_GPU_IS_LOST
        samples.append(engine.step())
    assert [s.token for s in samples] == list(range(9))
    assert all(s.kv_bytes_reserved == s.kv_bytes_predicted for s in samples)
    assert all(s.process_rss is not None and s.process_rss > 0 for s in samples)
    notes = probe.last_notes
    if case == "nvml-failing-mid-run":
        assert [s.device_used for s in samples[:4]] == [5 * GiB] * 4 and samples[0].process_gpu == GiB
        assert all(s.device_used is None and s.device_total is None and s.process_gpu is None for s in samples[4:])
        assert "NVML device memory failed: GPU is lost" in notes
    else:
        assert all(s.device_used is None and s.device_total is None and s.process_gpu is None for s in samples)
        assert any(n.startswith(NOTE_NO_NVML) for n in notes)
    probe.close()


def test_runtime_worker_raising_mid_token(qtbot, monkeypatch):
    """The model raises at token 3 inside a GenerationController run: `errored` carries the message,
    then `finished` fires, the tokens before it arrived, and no generation thread is left."""
    from kvscope.workers.generation import GenerationController

    _fail_forward(monkeypatch, call=5, make_error=lambda: RuntimeError("kernel exploded at token 3"))
    controller = GenerationController()
    errors: list[str] = []
    got: list = []
    controller.errored.connect(errors.append)
    controller.samples.connect(got.extend)
    with qtbot.waitSignals([controller.errored, controller.finished], order="strict", timeout=120_000):
        controller.start(RunRequest(device="cpu", max_new_tokens=50))
    assert errors == ["RuntimeError: kernel exploded at token 3"]
    qtbot.waitUntil(lambda: not controller.is_running(), timeout=2_000)
    assert controller.stop(timeout_s=1.0)
    qtbot.waitUntil(lambda: _os_threads("kvscope-generation") == [], timeout=1_000)
    assert [s.token for s in got if s.phase == "decode"] == [1, 2]


def test_runtime_worker_raising_mid_token_window_controls_come_back(qtbot, thread_window, monkeypatch):
    """The same fault in the window: the message is shown and Start is enabled again."""
    window = thread_window
    _fail_forward(monkeypatch, call=5, make_error=lambda: RuntimeError("kernel exploded at token 3"))
    run_in_window(qtbot, window, RunRequest(device="cpu", max_new_tokens=50))
    assert window.last_error == "RuntimeError: kernel exploded at token 3"
    assert window.controls.error_label.text() == window.last_error
    assert window.state == "idle" and window.controls.start_button.isEnabled()
    assert window.decode_tokens == 2


# ================================================================================================
# Files


@pytest.fixture(scope="module")
def real_recording(tmp_path_factory) -> Path:
    """A recording of a real 8-token run of the embedded model (load event, prefill, 8 tokens)."""
    path = tmp_path_factory.mktemp("rec") / "run.jsonl"
    run_generation(RunRequest(device="cpu", max_new_tokens=8, record_path=str(path)), RunHooks())
    return path


def _csv_rows(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()[1:]


DAMAGED = ["truncated", "corrupted", "empty", "unknown-version", "newer-version"]


@pytest.mark.parametrize("case", DAMAGED)
def test_files_damaged_recording_export(case, real_recording, tmp_path, capsys):
    """`main.py export FILE --csv OUT` on each damaged file. A cut-off last sample (a killed writer) or a
    damaged line is skipped and reported, and every readable sample is exported (nothing readable is
    lost); a file that is not a readable recording is refused in one line and no CSV is written."""
    lines = real_recording.read_bytes().splitlines(keepends=True)
    n = len(lines) - 1  # samples
    header = json.loads(lines[0])
    damaged = tmp_path / f"{case}.jsonl"
    if case == "truncated":
        damaged.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    elif case == "corrupted":
        damaged.write_bytes(b"".join(lines[:3]) + b'{"token": 2, "phase": \xff garbage\n' + b"".join(lines[4:]))
    elif case == "empty":
        damaged.write_bytes(b"")
    else:
        header["version"] = "2-beta" if case == "unknown-version" else 7
        damaged.write_bytes(json.dumps(header).encode() + b"\n" + b"".join(lines[1:]))
    out_csv = tmp_path / "out.csv"
    code, out, err = _cli(capsys, "export", str(damaged), "--csv", str(out_csv))
    if case in ("truncated", "corrupted"):
        assert code == 0, err
        assert "Traceback" not in err
        assert out.strip() == f"wrote {n - 1:,} samples to {out_csv}"
        assert len(_csv_rows(out_csv)) == n - 1
        if case == "truncated":
            assert f"recording {damaged.name}: the last sample was cut off (the recording was interrupted)" in err
        else:
            assert f"recording {damaged.name}: skipped 1 damaged line (first: line 4: not valid JSON)" in err
        return
    line = one_line_error(code, err)
    assert not out_csv.exists() and list(tmp_path.glob("*.csv")) == [] and list(tmp_path.glob(".*tmp")) == []
    assert line == {
        "empty": f"kvscope: recording {damaged.name} is empty",
        "unknown-version": f"kvscope: recording {damaged.name} has an unknown version '2-beta'; this KV Scope reads "
                           "versions 1 to 2",
        "newer-version": "kvscope: recording version 7 is newer than this KV Scope (reads up to 2); update KV Scope",
    }[case]


def test_files_replay_broken_recording_real_process(tmp_path):
    """`python main.py replay broken.jsonl --screenshot x.png`: exit 2, one line, no PNG, no window opened
    (main.py reads the header before it starts Qt)."""
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"format": "kvscope-recording", "version": 1, "model": {"na')  # header cut mid-line
    shot = tmp_path / "x.png"
    env = {k: v for k, v in os.environ.items() if k != "KVSCOPE_DEBUG"}
    out = subprocess.run([sys.executable, str(ROOT / "main.py"), "replay", str(broken), "--screenshot", str(shot)],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    line = one_line_error(out.returncode, out.stderr)
    assert line == "kvscope: recording broken.jsonl is truncated: its header line is incomplete"
    assert out.stderr.strip() == line and not shot.exists()


def test_files_large_recording_export_streams(tmp_path):
    """A ~120 MB recording exported to CSV by a real `main.py export` process whose peak RSS stays far
    below the file size (streamed line by line, never loaded whole; the CSV is written as it goes)."""
    path = tmp_path / "large.jsonl"
    header = {"app_version": "test", "model": {"name": "tiny"}, "device": {"name": "cpu"}, "settings": {}}
    with RecordingWriter(path, header, fsync_interval_s=None):
        pass
    row = {"token": 7, "phase": "decode", "time_s": 0.5, "text": "t" * 20_000, "attention": "mha",
           "attn_impl": "sdpa", "cache": "dynamic", "kernel": "sdpa", "device": "cpu", "dtype": "float32",
           "kv_bytes_observed": 4096, "kv_bytes_storage": 4096, "weights_bytes": 1000, "kv_bytes_predicted": 4096}
    template = json.dumps(row)
    n = 6000
    with open(path, "a", encoding="utf-8") as f:
        for i in range(n):
            f.write(template.replace('"token": 7,', f'"token": {i},', 1) + "\n")
    size = path.stat().st_size
    assert size > 100 * 2**20
    out_csv = tmp_path / "large.csv"
    child = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "export", str(path), "--csv", str(out_csv)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = psutil.Process(child.pid)
    peak = 0
    while child.poll() is None:
        try:
            peak = max(peak, proc.memory_info().rss)
        except psutil.Error:
            break
        time.sleep(0.005)
    stdout, stderr = child.communicate(timeout=300)
    assert child.returncode == 0, stderr
    assert stdout.strip() == f"wrote {n:,} samples to {out_csv}"
    assert out_csv.stat().st_size > 100 * 2**20
    print(f"export of {size / 2**20:.0f} MiB: child peak RSS {peak / 2**20:.1f} MiB")
    assert 0 < peak < size / 3, f"peak RSS {peak / 2**20:.1f} MiB for a {size / 2**20:.0f} MiB recording"


BAD_CONFIGS = {
    # case: (changes to the embedded model's config (None: delete the key), what the one line says)
    "negative-heads": ({"num_attention_heads": -8}, "number of attention heads must be positive, got -8"),
    "zero-layers": ({"num_hidden_layers": 0}, "number of layers must be positive, got 0"),
    "non-numeric": ({"hidden_size": "big"}, "hidden size must be a whole number, got 'big'"),
    "heads-not-divisible-by-kv-heads": ({"num_key_value_heads": 3}, "3 KV heads do not divide 8 query heads"),
    "missing-vocab": ({"vocab_size": None}, "config is missing the vocab_size"),
    "missing-heads": ({"num_attention_heads": None}, "config is missing the number of attention heads"),
    "nan-layers": ({"num_hidden_layers": math.nan}, "number of layers must be a whole number, got nan"),
    "infinite-hidden-size": ({"hidden_size": math.inf}, "hidden size must be a whole number, got inf"),
    "absurd-layer-count": ({"num_hidden_layers": 10**12}, "1,000,000,000,000 layers is implausible"),
    "not-json": ("{nope", "is not valid JSON (line 1: "),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_files_calculator_bad_config(case, tmp_path, capsys):
    """`main.py calc --model bad.json`: one line naming the file's problem, exit 2, promptly."""
    changes, expected = BAD_CONFIGS[case]
    path = tmp_path / f"{case}.json"
    if isinstance(changes, str):
        path.write_text(changes)
    else:
        cfg = json.loads((ROOT / "assets" / "presets" / "embedded.json").read_text())
        cfg.pop("_kvscope")
        for key, value in changes.items():
            cfg.pop(key) if value is None else cfg.__setitem__(key, value)
        path.write_text(json.dumps(cfg))  # NaN / Infinity as Python's json writes (and reads) them
    t0 = time.perf_counter()
    line = one_line_error(*_cli(capsys, "calc", "--model", str(path))[::2])
    assert expected in line
    assert time.perf_counter() - t0 < 30  # an absurd layer count must not build 10**12 layers


# ================================================================================================
# Shutdown and churn


def test_runtime_engine_process_killed_mid_run(qtbot, window):
    """The engine process dies mid-run (SIGKILL: what the OOM killer or a crash in a kernel does): the
    window says so in one line, stays up with its controls back, and the next run starts a new engine."""
    import signal

    host = window.controller.host
    window.start_run(RunRequest(device="cpu", max_new_tokens=100_000))
    qtbot.waitUntil(lambda: window.decode_tokens >= 3, timeout=120_000)
    old_pid = host.pid
    with qtbot.waitSignal(window.run_finished, timeout=10_000):
        os.kill(old_pid, signal.SIGKILL)
    assert window.last_error == ("the engine process ended during the run (killed by signal 9); "
                                 "the next run starts a new one")
    assert window.controls.error_label.text() == window.last_error
    assert window.state == "idle" and window.controls.start_button.isEnabled()
    run_in_window(qtbot, window, RunRequest(device="cpu", max_new_tokens=5))
    assert window.last_error == "" and window.decode_tokens == 5
    assert host.pid not in (None, old_pid)


@pytest.mark.parametrize("engine", ["process", "thread"])
def test_shutdown_close_window_mid_generation(qtbot, request, engine):
    """Closing the window while it generates returns within 1 s and leaves no KV Scope thread running
    (the engine process's reader stays, idle, for the next window; the process itself is idle)."""
    window = request.getfixturevalue("window" if engine == "process" else "thread_window")
    window.start_run(RunRequest(device="cpu", max_new_tokens=100_000))
    qtbot.waitUntil(lambda: window.decode_tokens >= 3, timeout=120_000)
    assert window.controller.is_running()
    if engine == "thread":
        assert "kvscope-generat" in _os_threads()
    python_threads = {t.ident for t in threading.enumerate()}
    t0 = time.perf_counter()
    window.close()
    elapsed = time.perf_counter() - t0
    print(f"window.close() mid-generation took {elapsed * 1000:.0f} ms")
    assert elapsed < 1.0
    assert not window.controller.is_running()
    # The QThreads' OS threads have exited; only the shared engine's pipe reader stays (idle, for the
    # next window) once an engine process exists in this test session.
    qtbot.waitUntil(lambda: [n for n in _os_threads() if n != "kvscope-engine-"] == [], timeout=500)
    assert {t.ident for t in threading.enumerate()} <= python_threads
    assert window.decode_tokens < 100_000
    if engine == "process":
        assert window.controller.host.run_done.is_set()  # the engine's run ended, not just our view of it


CHURN_CYCLE = ["gqa:4", "gqa:2", "mqa", "window:16", "mha", "mla", "gqa:2", "window:16", "mqa", "mha", "gqa:4", "mla"]


def _live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable through the garbage collector (CPU)."""
    import gc
    import warnings

    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on deprecated torch aliases warns; irrelevant here
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and not obj.is_meta:
                    storage = obj.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
            except Exception:  # noqa: BLE001 - tensors in odd states (inference/FakeTensor) are skipped
                continue
    return sum(seen.values())


def test_churn_200_attention_switches_exact_cache_bytes():
    """200 rapid attention-mode switches (Engine.apply, a token after every third) leave the live cache
    at exactly the bytes kvscope.core.prediction.predict.kv_bytes gives for the mode in force, after every switch.

    The issue also asks that on CUDA the allocator be back at its baseline; there is no GPU here, so
    that half is not tested. The CPU stand-in: after the churn, back in MHA, the bytes of all live
    tensors exceed those before it by exactly the cache growth of the tokens generated plus the MLA
    twin the engine keeps for the next MLA switch, i.e. no converted cache or weight is left behind.
    (On CUDA the same references are dropped; the caching allocator then keeps the freed blocks
    reserved, which torch.cuda.empty_cache() returns; scripts/gpu_check.sh is where that is watched.)
    """
    engine = Engine(load_model("embedded", device="cpu"), RunSettings(), seed=0)
    ids = torch.randint(3, engine.spec.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    engine.prefill(ids, "p")
    baseline_bytes = _live_tensor_bytes()
    baseline_kv = cache_bytes(engine.cache).logical
    for i in range(200):
        mode = CHURN_CYCLE[i % len(CHURN_CYCLE)]
        event = engine.apply("attention", mode)
        expected = kv_bytes(engine.spec, RunSettings(attention=parse_attention(mode)), engine.seq_len)
        observed = cache_bytes(engine.cache).logical
        assert engine.mode.key == mode and event.event == "switch"
        assert observed == expected == event.kv_bytes_reserved == event.kv_bytes_predicted, (i, mode, event.text)
        if i % 3 == 2:
            s = engine.step()
            assert s.kv_bytes_reserved == s.kv_bytes_predicted == kv_bytes(
                engine.spec, RunSettings(attention=parse_attention(mode)), engine.seq_len), (i, mode)
    assert engine.generated == 66 and engine.seq_len == 12 + 66
    engine.apply("attention", "mha")
    final_kv = cache_bytes(engine.cache).logical
    assert final_kv == kv_bytes(engine.spec, RunSettings(attention=MHA()), engine.seq_len)
    assert final_kv == baseline_kv * engine.seq_len // 12
    grown = _live_tensor_bytes() - baseline_bytes
    expected_growth = final_kv - baseline_kv  # MLA is a latent in the cache: no second model is kept
    # The aligned merge keeps one calibration per layer (Gram matrices of the model's own K/V), for later merges.
    expected_growth += sum(c.nbytes for c in engine._merge_calibration.values())
    # Small tensors come and go (token ids, logits, rotary caches): a few KiB, against MiBs of KV and weights.
    assert abs(grown - expected_growth) < 64 * 1024, (grown, expected_growth)
