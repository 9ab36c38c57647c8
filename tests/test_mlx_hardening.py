"""The MLX runtime's hardening (issue 38, the MLX items), with the real MLX on the CPU and tiny models built here.

1. A quantized cache (``--kv-bits B --kv-group-size G``) never crashes on its empty state: mlx-lm 0.32.2's
   ``QuantizedKVCache.nbytes`` raises on ``keys=None``, and KV Scope reads an empty cache as 0 bytes; observed ==
   predicted byte for byte for bits 2/4/8 x groups 32/64 over a run that crosses a 256-token step, in the
   terminal's and the window's paths. Settings MLX refuses are refused, in one line, before MLX sees them (a group
   of 0 is SIGFPE inside ``mx.quantize``) or with mlx-lm's own message.
2. A prompt longer than the model's declared positions is refused before the prefill.
3. ``tokenizer_config.json``'s ``chat_template_type`` / ``tool_parser_type`` (module names mlx-lm imports) are
   refused unless the installed mlx-lm ships them, or the user passed ``--trust-remote-code``.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil

import pytest

from kvscope.core.base.errors import GenerationError
from kvscope.core.model.attention import SettingsError
from kvscope.core.runtimes.mlx.predict import (GROUP_SIZES, QUANT_BITS, QUANTIZED, STEP, LayerShape, MlxCache,
                                               parse_cache, quantize_problem, slot_bytes)
from kvscope.core.runtimes.mlx.switches import mlx_missing

MISSING = mlx_missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"{MISSING} (make test installs the mlx extra)")

#: The issue's grid: bits x group sizes, each run across a 256-token step.
GRID = list(itertools.product((2, 4, 8), (32, 64)))


@pytest.fixture(scope="module")
def embedded_folder():
    from kvscope.core.model.embedded import embedded_model_dir

    return embedded_model_dir()


def _said(err: str) -> str:
    """The one line ``main`` printed for a refusal (progress lines aside); no traceback."""
    lines = [line for line in err.splitlines() if line.startswith("kvscope:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _tiny_llama(folder, embedded, *, head_dim: int = 64, max_positions: int | None = 4096, seed: int = 0,
                tokenizer_fields: dict | None = None):
    """A 2-layer Llama with random weights (head dim 64, so groups of 64 fit) and the embedded model's tokenizer,
    written as mlx-lm reads one. ``tokenizer_fields`` are added to tokenizer_config.json."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    folder.mkdir(parents=True, exist_ok=True)
    for f in embedded.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, folder / f.name)
    if tokenizer_fields:
        tc = json.loads((folder / "tokenizer_config.json").read_text())
        tc.update(tokenizer_fields)
        (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
              "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": head_dim, "vocab_size": 1024, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": True, "torch_dtype": "float32", "rope_theta": 10000.0,
              "eos_token_id": 2, "bos_token_id": 1}
    if max_positions is not None:
        config["max_position_embeddings"] = max_positions
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, embedded_folder):
    return _tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama-d64", embedded_folder)


# ---------------------------------------------------------------------------------------------------- 1: nbytes


@pytest.mark.parametrize("bits,group", list(itertools.product(QUANT_BITS, GROUP_SIZES)))
def test_an_empty_quantized_cache_holds_0_bytes(bits, group):
    """mlx-lm's own nbytes raises on the empty state (the crash of the issue); KV Scope's reading is 0 there and
    mlx-lm's figure once the cache holds a token."""
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache

    from kvscope.core.runtimes.mlx.engine import cache_nbytes, layer_nbytes

    c = QuantizedKVCache(group_size=group, bits=bits)
    with pytest.raises(AttributeError, match="NoneType"):
        c.nbytes  # noqa: B018 - mlx-lm 0.32.2: tree_reduce over (None, None)
    assert c.empty() and layer_nbytes(c) == 0 and cache_nbytes([c, c]) == 0
    layer = LayerShape(heads=2, k_dim=128, v_dim=128, itemsize=4)  # 128: a multiple of every group
    if quantize_problem((layer,), MlxCache(QUANTIZED, bits=bits, group_size=group)):  # 5 and 6 bits at 128
        with pytest.raises(ValueError, match="broadcast"):
            c.update_and_fetch(mx.zeros((1, 2, 1, 128)), mx.zeros((1, 2, 1, 128)))
        return
    c.update_and_fetch(mx.zeros((1, 2, 1, 128)), mx.zeros((1, 2, 1, 128)))
    assert not c.empty()
    assert layer_nbytes(c) == c.nbytes == STEP * slot_bytes(layer, MlxCache(QUANTIZED, bits=bits, group_size=group))


def test_layer_nbytes_reads_only_the_empty_state_as_0():
    """A cache that is not empty and fails to count itself is an error, not 0 bytes."""
    from kvscope.core.runtimes.mlx.engine import layer_nbytes

    class Broken:
        @property
        def nbytes(self):
            raise AttributeError("not the empty state")

        def empty(self):
            return False

    with pytest.raises(AttributeError, match="not the empty state"):
        layer_nbytes(Broken())


def _exact_run(folder, cache: str, prompt: str, until: int):
    from kvscope.core.runtimes.mlx.engine import MlxEngine

    engine = MlxEngine(folder, cache, seed=5)
    try:
        samples = [engine.event("load", "loaded")]  # the start event: the cache still empty
        samples.append(engine.prefill(prompt))
        while samples[-1].context_tokens < until:
            samples.append(engine.step())
        slot = sum(slot_bytes(l, engine.cache_setting) for l in engine.layers)
    finally:
        engine.close()
    return samples, slot


@pytest.mark.parametrize("bits,group", GRID, ids=[f"q{b}g{g}" for b, g in GRID])
def test_quantized_observed_equals_predicted_across_a_step(tiny_folder, bits, group):
    """Bits 2/4/8 x groups 32/64 from the first token: the empty start, the prefill, and one token at a time past
    256: observed (the arrays' nbytes) == predicted at every sample, the step taken when the predictor says."""
    samples, slot = _exact_run(tiny_folder, f"quantized:{bits}:{group}", " the" * 240, STEP + 3)
    assert samples[0].kv_bytes_reserved == samples[0].kv_bytes_predicted == 0
    bad = [(s.token, s.context_tokens, s.kv_bytes_reserved, s.kv_bytes_predicted) for s in samples
           if s.kv_bytes_reserved != s.kv_bytes_predicted]
    assert not bad, bad[:5]
    for s in samples[1:]:
        assert s.kv_bytes_reserved == -(-s.context_tokens // STEP) * STEP * slot, s.context_tokens
    assert {s.kv_bytes_reserved for s in samples[1:]} == {STEP * slot, 2 * STEP * slot}  # the step was crossed


def test_the_readme_commands_run_in_the_terminal(capsys):
    """``run --runtime mlx --kv-bits 8 --kv-group-size 32`` (the README's) and 2 bits: exit 0, exact."""
    from kvscope import main

    for bits in (8, 2):
        assert main.main(["run", "--runtime", "mlx", "--kv-bits", str(bits), "--kv-group-size", "32",
                          "--tokens", "4"]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert f"cache quantized:{bits}:32" in out and "observed == predicted at 5 of 5 samples" in out, out


def test_the_window_path_runs_a_quantized_cache(embedded_folder):
    """The window's engine side (RunDriver, the shared run loop) with a quantized cache: no error, every sample
    exact, the start event's empty cache at 0 bytes."""
    from kvscope.core.live.engine_process import RunDriver
    from kvscope.core.model.request import RunRequest
    from kvscope.core.runtimes.mlx.switches import MlxOptions

    for cache in ("quantized:8:32", "quantized:2:32"):
        messages = []
        request = RunRequest(source="embedded", runtime="mlx", options={"mlx": MlxOptions(cache=cache)}, max_new_tokens=4,
                             prompt="Keys and values.")
        RunDriver(request, lambda kind, payload: messages.append((kind, payload))).run()
        assert not [p for k, p in messages if k == "errored"], messages[-3:]
        samples = [s for k, p in messages if k == "samples" for s in p]
        kv = [s for s in samples if s.kv_bytes_reserved is not None]
        assert kv and kv[0].kv_bytes_reserved == 0 and kv[-1].kv_bytes_reserved > 0
        assert all(s.kv_bytes_reserved == s.kv_bytes_predicted for s in kv)
        assert sum(s.phase == "decode" for s in samples) == 4 and {s.cache for s in kv} == {cache}


# ---------------------------------------------------------------------------------------------------- 1: refusals


def _mx_accepts(bits: int, group: int) -> bool:
    """mx.quantize's own verdict on 512 values (a multiple of every group it takes); never asked a group <= 0
    (SIGFPE: the process would die)."""
    import mlx.core as mx

    assert group > 0
    try:
        mx.eval(mx.quantize(mx.zeros((1, 2, 1, 512)), group_size=group, bits=bits))
    except ValueError:
        return False
    return True


BITS_TRIED = list(range(-1, 10)) + [16, 32]
GROUPS_TRIED = [-64, -1, 0, 1, 16, 31, 32, 48, 64, 96, 128, 256, 512]


def test_parse_cache_takes_what_mx_quantize_takes():
    """Every bits x group: parse_cache accepts exactly what mx.quantize accepts, and refuses a group <= 0 itself."""
    checked = 0
    for bits, group in itertools.product(BITS_TRIED, GROUPS_TRIED):
        if group <= 0 or bits < 0:  # not spellable as quantized:B:G (digits only): the flags' path
            from kvscope.core.runtimes.mlx.predict import quantized_cache

            with pytest.raises(SettingsError, match="mx.quantize refuses"):
                quantized_cache(bits, group, "x")
            continue
        accepted = _mx_accepts(bits, group)
        try:
            parse_cache(f"quantized:{bits}:{group}")
        except SettingsError as exc:
            assert not accepted, (bits, group, str(exc))
            assert "\n" not in str(exc) and "mx.quantize refuses" in str(exc)
        else:
            assert accepted, (bits, group)
        checked += 1
    assert checked == 12 * 10  # the 12 bits >= 0 x the 10 groups > 0


#: Head dims of real models: the predictor's rule and mlx-lm's own refusal must agree on each.
HEAD_DIMS = (32, 64, 80, 96, 128, 256)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_predictor_refuses_what_mlx_lm_refuses(head_dim):
    """A QuantizedKVCache of zeros through mlx-lm's attention (``quantized_refusal``) against ``quantize_problem``:
    the same verdict for every bits x group; where both take it, the predicted slot is the real one."""
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache

    from kvscope.core.runtimes.mlx.engine import quantized_refusal

    layer = LayerShape(heads=2, k_dim=head_dim, v_dim=head_dim, itemsize=4)
    verdicts = []
    for bits, group in itertools.product(QUANT_BITS, GROUP_SIZES):
        cache = MlxCache(QUANTIZED, bits=bits, group_size=group)
        mlx_says, we_say = quantized_refusal((layer,), cache), quantize_problem((layer,), cache)
        assert (mlx_says is None) == (we_say is None), (head_dim, bits, group, mlx_says, we_say)
        if mlx_says is not None:
            assert "\n" not in mlx_says and "refuses" in mlx_says
        else:
            c = QuantizedKVCache(group_size=group, bits=bits)
            c.update_and_fetch(mx.zeros((1, 2, 3, head_dim)), mx.zeros((1, 2, 3, head_dim)))
            assert c.nbytes == STEP * slot_bytes(layer, cache)
        verdicts.append(mlx_says is None)
    # 2, 4 and 8 bits in groups of 32 fit a head dim that is a multiple of 32; 80 (Phi-2's) takes no group at all
    assert (verdicts[list(itertools.product(QUANT_BITS, GROUP_SIZES)).index((8, 32))]) == (head_dim % 32 == 0)
    if head_dim == 256:  # 3 bits: 25 uint32 per row kept, 24 written
        assert quantize_problem((layer,), MlxCache(QUANTIZED, bits=3, group_size=32))


@pytest.mark.parametrize("flags,says", [
    (["--kv-bits", "8", "--kv-group-size", "0"], "refuses groups of 0"),
    (["--kv-bits", "8", "--kv-group-size", "-1"], "refuses groups of -1"),
    (["--kv-bits", "7"], "refuses 7 bits"),
    (["--kv-bits", "0", "--kv-group-size", "32"], "refuses 0 bits"),
    (["--kv-bits", "8", "--kv-group-size", "64"], "divisible by the quantization group size 64"),  # MLX's words
])
def test_the_cli_refuses_in_one_line(flags, says, capsys):
    """What MLX refuses, ``run`` and ``calc`` refuse: exit 2 and one line (calc used to take a group of 0 as 64)."""
    from kvscope import main

    assert main.main(["run", "--runtime", "mlx", "--tokens", "2"] + flags) == 2
    assert says in _said(capsys.readouterr().err)
    status = main.main(["calc", "--runtime", "mlx", "--context", "300"] + flags)
    out, err = capsys.readouterr()
    if "group size 64" in says:  # calc shows the refusal in its table (the head dim is the model's)
        assert status == 0 and "refused" in out
    else:
        assert status == 2 and says in _said(err), (out, err)


def test_a_live_switch_mlx_lm_refuses_is_a_refused_event(embedded_folder):
    from kvscope.core.runtimes.mlx.engine import MlxEngine

    engine = MlxEngine(embedded_folder, "kv", seed=1)
    try:
        engine.prefill("x")
        engine.step()
        refused = engine.apply("cache", "quantized:8:64")
        assert refused.event == "refused" and "divisible by the quantization group size 64" in refused.text
        assert engine.cache_key == "kv" and refused.kv_bytes_reserved == refused.kv_bytes_predicted > 0
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------------------- 2: positions


def test_a_prompt_past_the_positions_is_refused_before_the_prefill(tmp_path, embedded_folder):
    from kvscope.core.runtimes.mlx.engine import MlxEngine

    folder = _tiny_llama(tmp_path / "short-llama", embedded_folder, max_positions=16)
    engine = MlxEngine(folder, "kv")
    calls = []
    engine._forward = lambda ids: calls.append(len(ids))  # the prefill never starts
    try:
        n = len(engine.tokenizer.encode(" the" * 40))
        with pytest.raises(GenerationError, match=f"the prompt is {n} tokens, more than .* maximum of 16"):
            engine.prefill(" the" * 40)
        assert calls == [] and engine.track.offset == 0
        exact = next(k for k in range(1, 40) if len(engine.tokenizer.encode(" the" * k)) == 16)
        with pytest.raises(GenerationError, match="none is left for a token"):
            engine.prefill(" the" * exact)
        assert calls == []
    finally:
        engine.close()
    engine = MlxEngine(folder, "kv")
    try:
        first = engine.prefill(" the" * (exact - 2))  # fits, with room
        assert first.context_tokens < 16 and engine.step().phase == "decode"
    finally:
        engine.close()


def test_max_positions_1_refuses_in_one_line(tmp_path, embedded_folder, capsys):
    """The issue's: max positions 1 generated 0 tokens and exited 0 without a word."""
    from kvscope import main

    folder = _tiny_llama(tmp_path / "one-position", embedded_folder, max_positions=1)
    assert main.main(["run", "--runtime", "mlx", "--model", str(folder), "--tokens", "3"]) == 2
    assert "more than one-position's maximum of 1 (max_position_embeddings)" in _said(capsys.readouterr().err)


def test_an_undeclared_maximum_is_no_reason_to_refuse(tmp_path, embedded_folder):
    from kvscope.core.runtimes.mlx.engine import MlxEngine

    folder = _tiny_llama(tmp_path / "no-max", embedded_folder, max_positions=None)
    engine = MlxEngine(folder, "kv")
    try:
        assert engine.prefill(" the" * 30).context_tokens > 16
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------------------- 3: imports

FIELDS = ("chat_template_type", "tool_parser_type")


def _hostile_names(seed: int = 38) -> list:
    """Names no installed mlx-lm ships, seeded: paths, dotted names, private modules, non-strings, control
    characters, long ones, and random identifiers."""
    rng = random.Random(seed)
    fixed = ["nosuch", "../../utils", "..", ".", "utils", "os", "__init__", "_private", "deepseek_v32.os",
             "mlx_lm.utils", "json_tools/../x", "json_tools ", "JSON_TOOLS", "qwen3_coder\x1b[2J", "x" * 500,
             "tool_parsers", ["json_tools"], {"name": "json_tools"}, 3, True, 0.5]
    alphabet = "abcdefghijklmnopqrstuvwxyz_./\\-0123456789"
    randoms = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 24))) for _ in range(12)]
    return fixed + randoms


def test_shipped_modules_are_found_on_disk():
    from kvscope.core.runtimes.mlx.load import shipped_modules

    chat, tools = shipped_modules("chat_templates"), shipped_modules("tool_parsers")
    assert "deepseek_v32" in chat and {"json_tools", "qwen3_coder"} <= tools
    assert not any(n.startswith("_") for n in chat | tools)
    assert shipped_modules("nosuch_package") == frozenset()


def test_hostile_tokenizer_fields_are_refused_before_mlx_lm(tmp_path, embedded_folder):
    from kvscope.core.runtimes.mlx.load import shipped_modules
    from kvscope.core.runtimes.mlx.load import resolve_model

    folder = _tiny_llama(tmp_path / "hostile", embedded_folder)
    base = json.loads((folder / "tokenizer_config.json").read_text())
    refused = 0
    for field, value in itertools.product(FIELDS, _hostile_names()):
        package = "chat_templates" if field == "chat_template_type" else "tool_parsers"
        assert value not in shipped_modules(package) if isinstance(value, str) else True
        (folder / "tokenizer_config.json").write_text(json.dumps({**base, field: value}))
        with pytest.raises(SettingsError) as caught:
            resolve_model(str(folder))
        text = str(caught.value)
        assert field in text and "--trust-remote-code" in text, text
        assert "\n" not in text and "\x1b" not in text and len(text) < 600, text
        assert resolve_model(str(folder), trust_remote_code=True) == folder  # the user's opt-in
        refused += 1
    assert refused == 2 * len(_hostile_names())


def test_fields_mlx_lm_ignores_or_ships_pass(tmp_path, embedded_folder):
    from kvscope.core.runtimes.mlx.engine import MlxEngine
    from kvscope.core.runtimes.mlx.load import resolve_model

    folder = _tiny_llama(tmp_path / "fine", embedded_folder)
    base = json.loads((folder / "tokenizer_config.json").read_text())
    for extra in ({"chat_template_type": None}, {"chat_template_type": ""}, {"tool_parser_type": None},
                  {"tool_parser_type": "json_tools"}, {"chat_template_type": "deepseek_v32"}):
        (folder / "tokenizer_config.json").write_text(json.dumps({**base, **extra}))
        assert resolve_model(str(folder)) == folder, extra
    (folder / "tokenizer_config.json").write_text(json.dumps({**base, "tool_parser_type": "json_tools"}))
    engine = MlxEngine(folder, "kv")
    try:
        assert engine.tokenizer.tool_parser is not None  # mlx-lm imported the shipped module
    finally:
        engine.close()


def test_mlx_lm_really_imports_the_field_and_trusted_failures_say_one_line(tmp_path, embedded_folder):
    """Unchecked, mlx-lm imports the name from tokenizer_config.json (the issue's ModuleNotFoundError); trusted
    with --trust-remote-code, that failure is one line from the engine, not a traceback."""
    from mlx_lm.utils import load_tokenizer

    from kvscope.core.runtimes.mlx.engine import MlxEngine, MlxRunError

    for field in FIELDS:
        folder = _tiny_llama(tmp_path / f"trusted-{field}", embedded_folder, tokenizer_fields={field: "nosuch"})
        with pytest.raises(ModuleNotFoundError, match="nosuch"):
            load_tokenizer(folder)
        with pytest.raises(MlxRunError) as caught:
            MlxEngine(folder, "kv")
        assert "nosuch" in str(caught.value) and "\n" not in str(caught.value)


def test_run_refuses_a_hostile_folder_in_one_line(tmp_path, embedded_folder, capsys):
    from kvscope import main

    folder = _tiny_llama(tmp_path / "cli-hostile", embedded_folder, tokenizer_fields={"tool_parser_type": "../../utils"})
    assert main.main(["run", "--runtime", "mlx", "--model", str(folder), "--tokens", "2"]) == 2
    assert "tool_parser_type='../../utils'" in _said(capsys.readouterr().err)
