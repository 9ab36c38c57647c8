"""Issue 18, hardening round 2: bad command-line and model-folder inputs (cases 3, 6 and part of 7).

Every case drives the real CLI (``main.main([...])`` in this process; a real child process where the
point is that it ends, promptly, with its exit status) on the embedded demo model and on a tiny real
Llama saved with save_pretrained (random init, seed 0), with real files (configs, weights, pickles, a
FIFO, recordings). Refused input: exit 2, one ``kvscope:`` line on stderr, said last, no traceback, no
"internal error". Where ``calc`` and ``run`` both read a thing, both are driven and must say the same
line (``run`` adds the reminder that the embedded model always works). Faked, only at a boundary: the
model's forward raising the CPU allocator's error (as torch does when malloc fails), and, to show that
nothing is built or loaded before a refusal, transformers' ``from_pretrained`` / KV Scope's
``load_model`` replaced by a function that fails the test.

Case -> test (all in this file)

3. Untrusted model folder hangs ``run``
  num_hidden_layers=100000 with tiny weights (real process, < 60 s, was > 300 s)
                                         test_absurd_layer_count_refused_by_run_promptly_real_process
  weights checked against config.json before the model is built (safetensors headers + meta build):
  more layers than stored, wider hidden size, larger vocabulary, more KV heads, narrower MLP
                                         test_weights_checked_against_config_before_building[<change>]
6. Internal errors
  config.json not UTF-8, nested 100,000 deep (RecursionError), nested 900 deep, a JSON list / string /
  number, a directory                    test_config_file_refused_alike_by_calc_and_run[<case>]
  config.json that is a FIFO (real process: must not block)
                                         test_config_fifo_refused_without_blocking_real_process
  every count field x every bad value (num_key_value_heads NaN / "two", hidden_size 0 / negative,
  vocab_size 10**400, 2**70 heads, ...)  test_config_field_refused_alike_by_calc_and_run[<field>=<value>]
  transformers' own validation (hidden size not a multiple of the heads)
                                         test_transformers_refusal_alike_by_calc_and_run
  a config transformers cannot build (rope_theta "x")
                                         test_config_transformers_cannot_build_is_one_line
  --seed 2**70 / -1, --attention window:10**30 / gqa:10**30, --switch ²:attention=mqa (and ٣),
  --batch 10**20 / a 400-digit batch, --context / --max-context 1e307, --gpu-memory / --memory-budget
  1e300 (float overflows in calc), --model of 300 characters, --prompt-file not UTF-8
                                         test_command_line_value_refused[<case>]
  --batch beyond memory on the CPU ("DefaultCPUAllocator: can't allocate memory"): the out-of-memory
  path, in the batch's first allocation (real) and in a decode step
                                         test_batch_beyond_memory_takes_the_out_of_memory_path[<where>]
  malicious pickle with --allow-pickle (one line, the code never runs), and a corrupt one
                                         test_pickle_refused_by_torch_safe_loader_is_one_line[<case>]
  (a lone surrogate in sample text: handled elsewhere, not here)
7. Silently wrong
  two --switch at the same token (command-line order; by token first)
                                         test_switches_at_one_token_apply_in_command_line_order[<order>]
  an empty value for any option of calc or run (--memory-budget '' meant no budget, --model '' ran
  the embedded model while calc refused it): refused, the same line for both
                                         test_empty_option_value_refused_alike[<option>]
  a 20,003-token prompt on a 4,096-token model: refused before the weights load, with the numbers
                                         test_prompt_longer_than_model_maximum_refused_before_loading
  ... and, where the config comes only with the weights (hub), after loading, before the prefill
                                         test_prompt_longer_than_model_maximum_refused_after_loading
  a recording deleted (or replaced) mid-run no longer ends with "recorded to ..."
                                         test_recording_deleted_or_replaced_mid_run[<what>]
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from kvscope import main
from kvscope.core.live.terminal import TerminalView
from kvscope.core.model.embedded import embedded_model_dir
from kvscope.core.model.hf_config import MAX_JSON_DEPTH
from kvscope.core.model.request import DEFAULT_PROMPT
from kvscope.core.model.spec import EMPTY_MODEL_NAME, MAX_COUNT
from kvscope.core.records.recording import RecordingReader
from kvscope.core.runtimes.transformers import loading
from kvscope.core.runtimes.transformers.loading import EMBEDDED_HINT

ROOT = Path(__file__).resolve().parent.parent
from tests.helpers import hub_offline, one_line_error, run_args  # noqa: F401 - hub_offline: a fixture

pytestmark = pytest.mark.usefixtures("hub_offline")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
EMBEDDED_LABEL = "embedded demo model"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny real Llama folder: 2 layers, hidden 64, 4 heads / 2 KV heads, vocab 1024 (the embedded
    model's byte-level tokenizer), maximum 256 positions."""
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, vocab_size=1024,
                                 max_position_embeddings=256)).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(embedded_model_dir() / name, folder / name)
    return folder


def _folder(tiny: Path, where: Path, changes: dict | None = None, config_bytes: bytes | None = None) -> Path:
    """A copy of the tiny model (weights hard-linked) whose config.json has ``changes`` or is ``config_bytes``."""
    where.mkdir(parents=True)
    for item in tiny.iterdir():
        if item.name != "config.json":
            os.link(item, where / item.name)
    if config_bytes is None:
        cfg = json.loads((tiny / "config.json").read_text())
        cfg.update(changes or {})
        config_bytes = json.dumps(cfg).encode()  # NaN, Infinity and 10**400 as Python's json writes them
    (where / "config.json").write_bytes(config_bytes)
    return where


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``main.main(argv)`` in this process; returns (exit status, stdout, stderr)."""
    code = main.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _calc_and_run_lines(capsys, model: str) -> tuple[str, str]:
    """The refusal of ``calc --model M`` and of ``run --model M``, checked to be the same line."""
    calc = one_line_error(*_cli(capsys, "calc", "--model", model)[::2])
    run = one_line_error(*_cli(capsys, *run_args(model))[::2])
    assert run == f"{calc} {EMBEDDED_HINT}"
    return calc, run


@pytest.fixture
def nothing_is_built(monkeypatch):
    """Fails the test if transformers builds or loads a model from a folder."""
    def build(*args, **kwargs):
        raise AssertionError("the model was built before the refusal")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", build)


@pytest.fixture
def nothing_is_loaded(monkeypatch):
    """Fails the test if run_generation gets as far as loading a model."""
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(loading, "load_model", load)  # run_generation imports it at call time


def _child_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("KVSCOPE_DEBUG", None)
    return env


# ================================================================================================
# 3. An untrusted model folder


def test_absurd_layer_count_refused_by_run_promptly_real_process(tiny, tmp_path, capsys):
    """`main.py run --model F` on the issue's folder (tiny weights, num_hidden_layers=100000) printed nothing
    for > 300 s while memory grew past 5 GB; now it ends at once with calc's line (calc: < 1 s)."""
    folder = _folder(tiny, tmp_path / "layers-100k", {"num_hidden_layers": 100_000})
    calc = one_line_error(*_cli(capsys, "calc", "--model", str(folder))[::2])
    assert calc == "kvscope: layers-100k: 100,000 layers is implausible (more than 4,096); check num_hidden_layers"
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, str(ROOT / "main.py"), *run_args(str(folder))], capture_output=True,
                         text=True, cwd=ROOT, env=_child_env(), timeout=120)
    elapsed = time.perf_counter() - t0
    line = one_line_error(out.returncode, out.stderr)
    assert line == f"{calc} {EMBEDDED_HINT}"
    assert out.stdout == ""
    assert elapsed < 60, f"took {elapsed:.0f} s"  # a child's start-up (torch, transformers) only


def _stored_values(folder: Path) -> int:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return sum(math.prod(handle.get_slice(k).get_shape()) for k in handle.keys())


def _config_parameters(folder: Path) -> int:
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder))
    return sum(p.numel() for p in model.parameters())


WEIGHT_MISMATCHES = {
    # change to config.json: what the one line names (None: the parameter counts, computed in the test)
    "more-layers-than-stored": ({"num_hidden_layers": 100}, None),
    "wider-hidden-size": ({"hidden_size": 128}, "lm_head.weight is [1024, 64] in the weights, [1024, 128] by the config"),
    "larger-vocabulary": ({"vocab_size": 2000}, "lm_head.weight is [1024, 64] in the weights, [2000, 64] by the config"),
    "more-kv-heads": ({"num_key_value_heads": 4},
                      "model.layers.0.self_attn.k_proj.weight is [32, 64] in the weights, [64, 64] by the config"),
    "narrower-mlp": ({"intermediate_size": 96},
                     "model.layers.0.mlp.down_proj.weight is [64, 128] in the weights, [64, 96] by the config"),
}


@pytest.mark.parametrize("case", list(WEIGHT_MISMATCHES))
def test_weights_checked_against_config_before_building(case, tiny, tmp_path, capsys, nothing_is_built):
    """Weights that do not fit config.json are refused from the safetensors headers and a meta-device build,
    before transformers builds the config's model (which allocates every tensor the files lack)."""
    changes, detail = WEIGHT_MISMATCHES[case]
    folder = _folder(tiny, tmp_path / case, changes)
    line = one_line_error(*_cli(capsys, *run_args(str(folder)))[::2])
    assert line.startswith(f"kvscope: {case}: the weights do not match config.json - ") and line.endswith(EMBEDDED_HINT)
    if detail is None:
        needed, held = _config_parameters(folder), _stored_values(folder)
        assert needed > 10 * held
        assert f"the config describes {needed:,} parameters, the weights hold {held:,} values" in line
    else:
        assert f"some tensors have other shapes than the config implies (e.g. {detail})" in line


# ================================================================================================
# 6. Internal errors: config files


def _nested(depth: int) -> bytes:
    return b'{"num_hidden_layers": 2, "deep": ' + b"[" * depth + b"]" * depth + b"}"


CONFIG_FILES = {
    # case: (config.json's bytes, or "dir" for a folder in its place; what calc's line says after "kvscope: <path> ")
    "not-utf8": (b'{"model_type": "llama", "name": "caf\xe9"}',
                 "is not UTF-8 text (byte 0xe9 at offset 36); a config.json is UTF-8 JSON"),
    "nested-100000-deep": (_nested(100_000), f"nests JSON more than {MAX_JSON_DEPTH} levels deep; it is not a model config"),
    "nested-900-deep": (_nested(900), f"nests JSON more than {MAX_JSON_DEPTH} levels deep; it is not a model config"),
    "json-list": (b"[1, 2]", "must hold a JSON object, found list"),
    "json-string": (b'"llama"', "must hold a JSON object, found str"),
    "json-number": (b"1e400", "must hold a JSON object, found float"),
    "a-directory": ("dir", "is a folder, not a JSON file"),
    # Python refuses to convert more than 4,300 digits: "internal error: ValueError" before (issue 29, item 6).
    "integer-5000-digits": (b'{"model_type": "llama", "vocab_size": ' + b"9" * 5000 + b"}",
                            "holds an integer of 5,000 digits; a config's numbers have at most 100"),
    "integer-101-digits": (b'{"model_type": "llama", "x": -' + b"1" * 101 + b"}",
                           "holds an integer of 101 digits; a config's numbers have at most 100"),
}


@pytest.mark.parametrize("case", list(CONFIG_FILES))
def test_config_file_refused_alike_by_calc_and_run(case, tiny, tmp_path, capsys, nothing_is_built):
    """config.json that is no JSON object, not UTF-8, absurdly nested, or a folder: one reader
    (kvscope.core.model.hf_config.read_config_json) for calc and run, so one line for both (they were internal errors:
    UnicodeDecodeError, RecursionError)."""
    content, expected = CONFIG_FILES[case]
    folder = _folder(tiny, tmp_path / case, config_bytes=b"{}")
    config = folder / "config.json"
    if content == "dir":
        config.unlink()
        config.mkdir()
    else:
        config.write_bytes(content)
    calc, _ = _calc_and_run_lines(capsys, str(folder))
    assert calc == f"kvscope: {config} {expected}"


SIZE_CHILD = """
import resource, sys, time, main
start = time.monotonic()
code = main.main(["calc", "--model", sys.argv[1]])
try:  # this process's own peak: ru_maxrss also counts the parent's memory when subprocess vforks (Linux)
    peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
except OSError:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("exit", code, f"{time.monotonic() - start:.3f}", peak, file=sys.stderr)
"""


def test_a_config_of_gigabytes_is_refused_by_its_size_unread(tiny, tmp_path):
    """A config.json of 3 GiB (sparse) was read whole before it was refused (6.3 GB of memory in the issue; 14.6 s
    and 2.1 GB for one of 1 GiB here): now its size is looked at first, one line names the size and the limit,
    in a real process that stays small."""
    from kvscope.core.model.hf_config import MAX_CONFIG_BYTES
    from kvscope.core.model.spec import human_bytes

    folder = _folder(tiny, tmp_path / "huge-config", config_bytes=b"{}")
    config = folder / "config.json"
    with open(config, "wb") as f:
        f.truncate(3 << 30)
    out = subprocess.run([sys.executable, "-c", SIZE_CHILD, str(folder)], capture_output=True, text=True, cwd=ROOT,
                         env=_child_env(), timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.startswith(("kvscope:", "exit"))]
    assert lines[0] == (f"kvscope: {config} is 3.0 GiB (3,221,225,472 bytes); a config.json is at most "
                        f"{human_bytes(MAX_CONFIG_BYTES)} here, so it was not read"), out.stderr
    _, code, seconds, maxrss_kib = lines[1].split()
    # the peak in KiB (VmHWM): calc's imports take ~20-600 MB; reading the file would add its 3 GiB.
    assert code == "2" and float(seconds) < 2 and int(maxrss_kib) < 1_500_000, lines[1]
    print(f"3 GiB config.json refused in {float(seconds):.3f} s at {int(maxrss_kib) // 1024} MiB")


FIFO_CHILD = """
import sys, main
for argv in (["calc", "--model", sys.argv[1]], ["calc", "--model", sys.argv[2]],
             ["run", "--model", sys.argv[1], "--device", "cpu", "--tokens", "2"]):
    print("exit", main.main(argv), file=sys.stderr, flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
def test_config_fifo_refused_without_blocking_real_process(tiny, tmp_path):
    """A config.json that is a FIFO (no writer: reading it blocks forever), given as a folder's config.json
    and directly: refused without reading it, by calc and run, in a real process that must end."""
    folder = _folder(tiny, tmp_path / "fifo-config", config_bytes=b"{}")
    config = folder / "config.json"
    config.unlink()
    os.mkfifo(config)
    out = subprocess.run([sys.executable, "-c", FIFO_CHILD, str(folder), str(config)], capture_output=True, text=True,
                         cwd=ROOT, env=_child_env(), timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr and "internal error" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith(("kvscope:", "exit"))]
    assert lines == [f"kvscope: {config} is not a regular file", "exit 2",
                     f"kvscope: {config} is not a regular file", "exit 2",
                     f"kvscope: {config} is not a regular file {EMBEDDED_HINT}", "exit 2"], out.stderr


# ------------------------------------------------------------------------------------------------
# Every count field of a config x every kind of bad value


COUNT_FIELDS = {  # config key: how the line names it
    "num_hidden_layers": "number of layers", "num_attention_heads": "number of attention heads",
    "num_key_value_heads": "number of KV heads", "hidden_size": "hidden size", "head_dim": "head_dim",
    "vocab_size": "vocab_size", "max_position_embeddings": "max_position_embeddings", "sliding_window": "sliding_window",
}
BAD_VALUES = {  # name: (value, what is wrong with it)
    "nan": (math.nan, "whole"), "infinity": (math.inf, "whole"), "word": ("two", "whole"), "fraction": (1.5, "whole"),
    "boolean": (True, "whole"), "list": ([2], "whole"), "zero": (0, "positive"), "negative": (-64, "positive"),
    "2**70": (2**70, "implausible"), "10**400": (10**400, "digits"),
}


def _expected_field_line(field: str, value, kind: str) -> str:
    what = COUNT_FIELDS[field]
    if kind == "whole":
        return f"{what} must be a whole number, got {value!r}"
    if kind == "positive":
        return f"{what} must be positive, got {value}"
    shown = f"{value:,}" if value < 10**24 else f"a {len(str(value))}-digit number"
    if field == "num_hidden_layers":
        return f"{shown} layers is implausible (more than 4,096); check num_hidden_layers"
    return f"{what} of {shown} is implausible (more than {MAX_COUNT:,})"


FIELD_CASES = [(field, bad) for field in COUNT_FIELDS for bad in BAD_VALUES
               # a falsy sliding_window means "no window" (0, as Qwen2 writes it): not an error
               if not (field == "sliding_window" and bad == "zero")]


@pytest.mark.parametrize("field,bad", FIELD_CASES, ids=[f"{f}={b}" for f, b in FIELD_CASES])
def test_config_field_refused_alike_by_calc_and_run(field, bad, tiny, tmp_path, capsys, nothing_is_built):
    """Each count of a model folder's config.json with each kind of bad value: calc and run refuse it with the
    same line naming the field, before anything is built (num_key_value_heads NaN or "two" were internal
    errors; hidden_size 0 ran into transformers; 10**400 overflowed a float; max_position_embeddings 0 was
    silently read as 2,048)."""
    value, kind = BAD_VALUES[bad]
    name = f"{field}-{bad}"
    folder = _folder(tiny, tmp_path / name, {field: value})
    calc, _ = _calc_and_run_lines(capsys, str(folder))
    if kind == "digits":  # refused by the config reader itself, before any field is looked at (issue 29)
        assert calc == (f"kvscope: {folder / 'config.json'} holds an integer of {len(str(value))} digits; "
                        "a config's numbers have at most 100")
        return
    assert calc == f"kvscope: {name}: {_expected_field_line(field, value, kind)}"


def test_transformers_refusal_alike_by_calc_and_run(tiny, tmp_path, capsys, nothing_is_built):
    """A config KV Scope's checks pass but transformers' own validation refuses (64 is not a multiple of 3
    heads): both say transformers' reason in one line (run: a multi-line internal error before)."""
    folder = _folder(tiny, tmp_path / "three-heads", {"num_attention_heads": 3, "num_key_value_heads": 1})
    calc, _ = _calc_and_run_lines(capsys, str(folder))
    assert calc == ("kvscope: three-heads: transformers refuses this config: The hidden size (64) is not a multiple "
                    "of the number of attention heads (3).")


def test_config_transformers_cannot_build_is_one_line(tiny, tmp_path, capsys):
    """A field transformers neither validates nor can build with (rope_theta "x"): calc answers (it needs no
    build), run says in one line that transformers cannot build the model (was: internal TypeError)."""
    folder = _folder(tiny, tmp_path / "rope-word", {"rope_parameters": {"rope_theta": "x", "rope_type": "default"}})
    code, out, err = _cli(capsys, "calc", "--model", str(folder))
    assert code == 0, err
    line = one_line_error(*_cli(capsys, *run_args(str(folder)))[::2])
    assert line.startswith("kvscope: rope-word: transformers cannot build the model its config.json describes (TypeError: ")
    assert line.endswith(EMBEDDED_HINT)


# ================================================================================================
# 6. Internal errors: command-line values


def _not_utf8_prompt(tmp_path: Path) -> str:
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    return str(path)


TOO_LONG = "9" * 300
CLI_VALUES = {
    # case: (commands, option, value (a callable of tmp_path for a file), the line)
    "seed-2**70": (("run",), "--seed", str(2**70),
                   "kvscope: --seed 1180591620717411303424: a seed is a whole number from 0 to 2**64 - 1 "
                   "(18,446,744,073,709,551,615)"),
    "seed-negative": (("run",), "--seed", "-1",
                      "kvscope: --seed -1: a seed is a whole number from 0 to 2**64 - 1 (18,446,744,073,709,551,615)"),
    "window-10**30": (("calc", "run"), "--attention", "window:1" + "0" * 30,
                      "kvscope: 'window:1000000000000000000000000000000': the number must be at most 2,147,483,647"),
    "gqa-10**30": (("calc", "run"), "--attention", "gqa:1" + "0" * 30,
                   "kvscope: 'gqa:1000000000000000000000000000000': the number must be at most 2,147,483,647"),
    "switch-superscript-two": (("run",), "--switch", "²:attention=mqa",
                               "kvscope: --switch '²:attention=mqa': write T:KEY=VALUE, e.g. 32:attention=mqa or "
                               "64:attn-impl=eager"),
    "switch-arabic-indic-three": (("run",), "--switch", "٣:attention=mqa",
                                  "kvscope: --switch '٣:attention=mqa': write T:KEY=VALUE, e.g. 32:attention=mqa or "
                                  "64:attn-impl=eager"),
    "batch-10**20": (("calc", "run"), "--batch", str(10**20),
                     "kvscope: batch 100,000,000,000,000,000,000 is implausible (more than 2,147,483,647)"),
    "batch-400-digits": (("calc", "run"), "--batch", "9" * 400,
                         "kvscope: batch a 400-digit number is implausible (more than 2,147,483,647)"),
    "context-1e307": (("calc",), "--context", "1e307",
                      "kvscope: --context: token count '1e307' is implausible (more than 2,147,483,647)"),
    "max-context-1e307": (("calc", "run"), "--max-context", "1e307",
                          "kvscope: --max-context: token count '1e307' is implausible (more than 2,147,483,647)"),
    "gpu-memory-1e300": (("calc",), "--gpu-memory", "1e300", "kvscope: --gpu-memory: size '1e300' is implausible (more than 16 EiB)"),
    "memory-budget-1e300": (("run",), "--memory-budget", "1e300",
                            "kvscope: --memory-budget: size '1e300' is implausible (more than 16 EiB)"),
    "model-name-too-long": (("calc", "run"), "--model", TOO_LONG,
                            f"kvscope: cannot use '{TOO_LONG}' as a model: File name too long"),
    "prompt-file-not-utf8": (("run",), "--prompt-file", _not_utf8_prompt, None),
}


@pytest.mark.parametrize("case", list(CLI_VALUES))
def test_command_line_value_refused(case, tmp_path, capsys, monkeypatch):
    """Values that were internal errors (torch's "Overflow when unpacking long", int("²"), float overflows in
    the calculator, OSError ENAMETOOLONG, UnicodeDecodeError): one line, before any model loads."""
    commands, option, value, expected = CLI_VALUES[case]
    if callable(value):
        value = value(tmp_path)
        expected = (f"kvscope: --prompt-file {value} is not UTF-8 text (it holds the byte 0xe9); save it as UTF-8")
    if option == "--model":
        lines = _calc_and_run_lines(capsys, value)
        assert lines[0] == expected
        return
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    for command in commands:
        argv = ["calc", option, value] if command == "calc" else run_args("embedded", option, value)
        line = one_line_error(*_cli(capsys, *argv)[::2])
        assert line == expected, command


def _options_of(command: str) -> set[str]:
    sub = next(a for a in main.build_parser()._actions if a.dest == "command").choices[command]
    return {s for a in sub._actions for s in a.option_strings if a.nargs != 0 and s.startswith("--")}


EMPTY_CASES = sorted(f"--{dest.replace('_', '-')}" for dest in main._NOT_EMPTY) + ["--switch"]


@pytest.mark.parametrize("option", EMPTY_CASES)
def test_empty_option_value_refused_alike(option, capsys, nothing_is_loaded):
    """`--memory-budget ''` meant no budget, `--max-context ''` no limit, `--prompt-file ''` the default
    prompt, `--model ''` the embedded model (calc refused it): every option of calc and run given an empty
    value is refused, with one line, the same for both commands."""
    lines = []
    for command in ("calc", "run"):
        if option not in _options_of(command):
            continue
        argv = [command, option, ""] if command == "calc" else ["run", "--device", "cpu", option, ""]
        lines.append(one_line_error(*_cli(capsys, *argv)[::2]))
    assert lines, f"{option} is not an option of calc or run"
    assert len(set(lines)) == 1, lines
    if option == "--model":
        assert lines[0] == f"kvscope: {EMPTY_MODEL_NAME}"
    elif option == "--switch":
        assert lines[0] == "kvscope: --switch is empty; write T:KEY=VALUE, e.g. 32:attention=mqa"
    else:
        assert lines[0].startswith(f"kvscope: {option} is empty; give ") and lines[0].endswith(", or leave the option out")


# ================================================================================================
# 6. Internal errors: out of memory, pickles


def _cpu_alloc_error() -> RuntimeError:
    return RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                        "you tried to allocate 421052631040 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize("where", ["batch-copies-real", "decode-step"])
def test_batch_beyond_memory_takes_the_out_of_memory_path(where, capsys, tmp_path, monkeypatch):
    """`run --batch N` beyond the host's memory: the CPU allocator's "can't allocate memory" takes the
    out-of-memory path (one line, cache freed, an "oom" event last in the recording), wherever it comes.

    "batch-copies-real": the largest batch allowed (2**31 - 1) on the embedded model, for real: its
    first allocation (the batch's copies of the prompt, hundreds of GB) fails at once in malloc; it used
    to come before the out-of-memory handling (an internal error). "decode-step": the error raised by
    the model's forward at token 2, where torch raises it when a decode step's allocation fails."""
    record = tmp_path / "oom.jsonl"
    if where == "batch-copies-real":
        if not sys.platform.startswith("linux") or Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1":
            pytest.skip("needs Linux without always-overcommit (malloc must refuse, not the OOM killer)")
        prompt_tokens = len(AutoTokenizer.from_pretrained(embedded_model_dir())(DEFAULT_PROMPT)["input_ids"])
        if MAX_COUNT * prompt_tokens * 8 <= psutil.virtual_memory().total + psutil.swap_memory().total:
            pytest.skip("this machine could hold the batch's copies of the prompt")
        argv = run_args("embedded", "--batch", str(MAX_COUNT), "--record", str(record))
        expected = "out of memory in prefill ("
    else:
        real_load = loading.load_model

        def load(*args, **kwargs):
            lm = real_load(*args, **kwargs)
            forward, calls = lm.model.forward, {"n": 0}

            def failing(*f_args, **f_kwargs):  # 1 = prefill, 2 = its trial pass, k + 2 = token k
                calls["n"] += 1
                if calls["n"] == 4:
                    raise _cpu_alloc_error()
                return forward(*f_args, **f_kwargs)

            lm.model.forward = failing
            return lm

        monkeypatch.setattr(loading, "load_model", load)
        argv = run_args("embedded", "--batch", "4", "--tokens", "5", "--record", str(record))
        expected = "out of memory in decode at token 2 ("
    line = one_line_error(*_cli(capsys, *argv)[::2])
    assert line.startswith(f"kvscope: {expected}") and "DefaultCPUAllocator: can't allocate memory" in line
    assert "cache freed. The predictor had said KV" in line
    with RecordingReader(record) as reader:
        samples = list(reader)
    assert samples[-1].event == "oom" and samples[-1].text == line.removeprefix("kvscope: ")


class _RunsCode:
    """Pickles as a call of exec: what a malicious pytorch_model.bin holds."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


@pytest.mark.parametrize("case", ["code-in-pickle", "not-a-pickle"])
def test_pickle_refused_by_torch_safe_loader_is_one_line(case, tiny, tmp_path, capsys):
    """With --allow-pickle, torch's safe loader (weights_only) blocks a pickle that calls code - good - but
    its paragraph came out as a multi-line internal error; now one line, and the code never ran."""
    folder = tmp_path / case
    folder.mkdir()
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(tiny / name, folder / name)
    marker = tmp_path / "code-ran"
    if case == "code-in-pickle":
        torch.save({"model.embed_tokens.weight": _RunsCode(marker)}, folder / "pytorch_model.bin")
    else:
        (folder / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    line = one_line_error(*_cli(capsys, *run_args(str(folder), "--allow-pickle"))[::2])
    if case == "code-in-pickle":
        assert line == (f"kvscope: {case}: pytorch_model.bin was refused by torch's safe loader: it asks to call exec, "
                        f"which plain weights never do; KV Scope does not load it (it may be malicious) {EMBEDDED_HINT}")
    else:
        assert line == (f"kvscope: {case}: pytorch_model.bin is not a readable weights pickle (torch's safe loader: "
                        f"Unsupported operand 110); it may be corrupt {EMBEDDED_HINT}")
    assert not marker.exists()


# ================================================================================================
# 7. Silently wrong


SAME_TOKEN = ("1:cache=static", "1:attention=mqa", "1:attn-impl=eager")
ORDERS = list(itertools.permutations(SAME_TOKEN))


@pytest.mark.parametrize("order", ORDERS, ids=["+".join(s.split(":")[1].split("=")[0] for s in o) for o in ORDERS])
def test_switches_at_one_token_apply_in_command_line_order(order, capsys):
    """Switches at one token apply in the order given (they were sorted by key and value); by token first:
    a switch at token 0 given last still applies first."""
    argv = run_args("embedded", "--tokens", "2")
    for switch in (*order, "0:attention=gqa:4"):
        argv += ["--switch", switch]
    code, out, err = _cli(capsys, *argv)
    assert code == 0, err
    applied = [line.split("] token ", 1)[1] for line in out.splitlines() if line.strip().startswith("-- [switch]")]
    assert [a.split(": ")[1] for a in applied] == ["attention", *(s.split(":")[1].split("=")[0] for s in order)]
    assert [a.split(":")[0] for a in applied] == ["0", "1", "1", "1"]
    assert applied[0].startswith("0: attention: mha -> gqa:4 ")


def _long_prompt(tmp_path: Path) -> tuple[str, int]:
    """A prompt file of 20,000 characters and its token count with the embedded model's tokenizer."""
    text = "KV " * 6_667  # 20,001 characters
    path = tmp_path / "long-prompt.txt"
    path.write_text(text, encoding="utf-8")
    n = len(AutoTokenizer.from_pretrained(embedded_model_dir())(text)["input_ids"])
    assert n > 4096
    return str(path), n


def test_prompt_longer_than_model_maximum_refused_before_loading(tmp_path, capsys, nothing_is_loaded):
    """A prompt far longer than the 4,096 positions of the embedded model ran with only a transformers
    warning; it is refused with the numbers before any weights load (the config and tokenizer are at hand)."""
    path, n = _long_prompt(tmp_path)
    line = one_line_error(*_cli(capsys, *run_args("embedded", "--prompt-file", path))[::2])
    assert line == (f"kvscope: the prompt is {n:,} tokens, more than {EMBEDDED_LABEL}'s maximum of 4,096 "
                    "(max_position_embeddings); shorten it or use a model with a longer context")


def test_prompt_longer_than_model_maximum_refused_after_loading(tmp_path, capsys, monkeypatch):
    """Where the config comes only with the weights (a hub model: no check before loading), the run refuses
    the same prompt once loaded, before the prefill."""
    from kvscope.core.runtimes.transformers import (
        runtime as transformers_runtime)  # the transformers runtime's own check

    monkeypatch.setattr(transformers_runtime, "_check_prompt_before_loading", lambda request, spec: None)
    path, n = _long_prompt(tmp_path)
    code, out, err = _cli(capsys, *run_args("embedded", "--prompt-file", path))
    line = one_line_error(code, err)
    assert line == (f"kvscope: the prompt is {n:,} tokens, more than {EMBEDDED_LABEL}'s maximum of 4,096 "
                    "(max_position_embeddings); shorten it or use a model with a longer context")
    assert "prefill" not in out and "-- [load]" in out  # loaded, refused before the first token


@pytest.mark.parametrize("what", ["deleted", "replaced"])
def test_recording_deleted_or_replaced_mid_run(what, tmp_path, capsys, monkeypatch):
    """The recording is deleted (or deleted and another file put in its place) at token 1 of a 3-token run:
    the run no longer ends with "recorded to ..." but says what happened (exit 2), after the summary."""
    record = tmp_path / "run.jsonl"
    real_emit = TerminalView.emit

    def emit(self, sample):
        real_emit(self, sample)
        if sample.phase == "decode" and sample.token == 1:
            record.unlink()
            if what == "replaced":
                record.write_text("someone else's file\n")

    monkeypatch.setattr(TerminalView, "emit", emit)
    code, out, err = _cli(capsys, *run_args("embedded", "--tokens", "3", "--record", str(record)))
    line = one_line_error(code, err)
    written = 5  # load event, prefill, 3 tokens
    assert line == {
        "deleted": f"kvscope: recording {record} was deleted during the run: its {written} samples are lost "
                   "(nothing was recorded)",
        "replaced": f"kvscope: recording {record} was replaced by another file during the run: this run's "
                    f"{written} samples are not in it",
    }[what]
    assert "recorded to" not in out and "observed == predicted at 4 of 4 samples" in out
    assert (record.read_text() == "someone else's file\n") if what == "replaced" else not record.exists()
