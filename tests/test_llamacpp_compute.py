"""llama.cpp's compute and output buffers (kvscope.core.prediction.llamacpp_compute) against the real llama.cpp, byte for byte.

Tiny GGUFs (tests/gguf_models.py: GQA and MHA llama, tied and untied, F16 and Q8_0 weights, interleaved-window
gemma3) and seeded random shapes of the same layouts that are not in the repository are loaded into the llama.cpp
that llama-cpp-python 0.3.36 builds, under a generated matrix of -c, -b, -ub, -fa, -ctk/-ctv, -np, --kv-unified and
--swa-full. For each load:

- the compute buffer equals, to the byte, what llama.cpp's scheduler reserved (``llama_get_memory_breakdown``:
  ``ggml_backend_sched_get_buffer_size``), and the MiB figure it logs (``sched_reserve: CPU compute buffer
  size``) is the prediction rounded as it rounds;
- the output buffer's logged MiB figure is the prediction's (n_vocab x n_seq_max x 4 B), on a model with a
  vocabulary large enough for the figure to show;
- ``calc --runtime llama.cpp --json`` carries both, and its total is their sum with the weights and the KV.
"""

from __future__ import annotations

import itertools
import json
import random
from contextlib import contextmanager

import pytest

from kvscope.core.model.attention import SettingsError
from kvscope.core.model.gguf import read_gguf
from kvscope.core.prediction.llamacpp import LlamaCppOptions, fit_llamacpp, plan
from tests import gguf_models

llama_cpp = pytest.importorskip("llama_cpp", reason="the llamacpp extra (make test installs it)")

from kvscope.core.runtimes.llamacpp.live import MIB  # noqa: E402
from kvscope.core.runtimes.llamacpp.observe import memory_breakdown, observe_buffers  # noqa: E402


@contextmanager
def _vocab(n: int):
    """The tiny models' vocabulary size (gguf_models.VOCAB) for the files written inside."""
    before = gguf_models.VOCAB
    gguf_models.VOCAB = n
    try:
        yield
    finally:
        gguf_models.VOCAB = before


def _random_shapes(seed: int = 24, n: int = 4) -> dict:
    """Layouts that are not in the repository: seeded random widths, heads, FFN sizes, layer counts, windows."""
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        head = rng.choice((16, 32, 64))
        n_head = rng.choice((2, 3, 4, 6))
        n_head_kv = rng.choice([d for d in (1, 2, 3, 6) if n_head % d == 0])
        n_ff = rng.choice((96, 160, 384))
        n_layer = rng.randint(1, 4)
        if i % 2 == 0:
            out[f"llama-random{i}"] = (lambda p, a=(n_layer, head * n_head, n_head, n_head_kv, n_ff, rng.random() < .5):
                                       gguf_models.llama(p, n_layer=a[0], n_embd=a[1], n_head=a[2], n_head_kv=a[3],
                                                         n_ff=a[4], tied=a[5], seed=100 + i))
        else:
            out[f"gemma3-random{i}"] = (lambda p, a=(rng.randint(6, 8), rng.choice((64, 96, 128)), n_head, n_head_kv,
                                                     head, n_ff, rng.choice((64, 100, 300))):
                                        gguf_models.gemma3(p, n_layer=a[0], n_embd=a[1], n_head=a[2], n_head_kv=a[3],
                                                           head=a[4], n_ff=a[5], n_swa=a[6], seed=100 + i))
    return out


def _qwen(path, arch: str, n_layer: int = 2, n_embd: int = 128, n_head: int = 4, n_head_kv: int = 2, head: int = 32,
          n_ff: int = 256, seed: int = 5):
    """A tiny qwen2 (Q/K/V biases) or qwen3 (per-head Q/K norms, head size of its own) as llama.cpp loads them
    (src/models/qwen2.cpp, qwen3.cpp load_arch_tensors)."""
    from kvscope.core.model.gguf_write import GgufVocab, write_gguf

    rng = gguf_models._rng(seed)
    tensors = [("token_embd.weight", gguf_models._mat(rng, n_embd, gguf_models.VOCAB)),
               ("output_norm.weight", gguf_models._norm(n_embd))]
    for i in range(n_layer):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", gguf_models._norm(n_embd))]
        tensors += gguf_models._attention_and_ffn(rng, b, n_embd, n_head, n_head_kv, head, n_ff)
        if arch == "qwen2":
            tensors += [(b + "attn_q.bias", gguf_models._norm(n_head * head)),
                        (b + "attn_k.bias", gguf_models._norm(n_head_kv * head)),
                        (b + "attn_v.bias", gguf_models._norm(n_head_kv * head))]
        else:
            tensors += [(b + "attn_q_norm.weight", gguf_models._norm(head)),
                        (b + "attn_k_norm.weight", gguf_models._norm(head))]
    meta = {"general.name": f"tiny {arch}", "context_length": 4096, "embedding_length": n_embd, "block_count": n_layer,
            "feed_forward_length": n_ff, "attention.head_count": n_head, "attention.head_count_kv": n_head_kv,
            "attention.key_length": head, "attention.value_length": head, "rope.dimension_count": head,
            "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e6}
    return write_gguf(path, arch, meta, tensors, GgufVocab.tiny(gguf_models.VOCAB))


MODELS = {
    "llama-gqa": lambda p: gguf_models.llama(p),
    "llama-mha-untied": lambda p: gguf_models.llama(p, n_head_kv=4, tied=False, n_layer=3),
    "llama-q8_0-weights": lambda p: gguf_models.llama(p, quant="q8_0"),
    "llama-head64": lambda p: gguf_models.llama(p, n_embd=256, n_head=4, n_head_kv=1),
    "gemma3-swa": lambda p: gguf_models.gemma3(p),
    "deepseek2-mla": lambda p: gguf_models.deepseek2(p),
    "qwen2-bias": lambda p: _qwen(p, "qwen2"),
    "qwen3-qknorm": lambda p: _qwen(p, "qwen3", n_layer=3, n_embd=96, n_head=4, n_head_kv=1, head=64),
    "deepseek2-mla-wide": lambda p: gguf_models.deepseek2(p, n_layer=3, n_embd=96, n_head=6, kv_lora_rank=32, rope=16,
                                                          nope=48, v_head=24, n_ff=160, seed=9),
    # deep enough for the replay to take repeated layers out of the middle (kvscope.core.prediction.llamacpp_compute._converged_mark)
    "llama-10-layers": lambda p: gguf_models.llama(p, n_layer=10, n_embd=64, n_head=2, n_head_kv=1, n_ff=128),
    "gemma3-20-layers": lambda p: gguf_models.gemma3(p, n_layer=20, n_embd=64, n_head=2, n_head_kv=1, head=32,
                                                     n_ff=128, n_swa=64),
    **_random_shapes(),
}
BIG_VOCAB = 60_000  # 60,000 x 4 B of logits per sequence: 0.23 MiB, a figure the log's 0.01 MiB shows


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-compute")
    files = {name: make(root / f"{name}.gguf") for name, make in MODELS.items()}
    with _vocab(BIG_VOCAB):
        files["llama-bigvocab"] = gguf_models.llama(root / "llama-bigvocab.gguf", n_layer=1)
    return files


def _matrix(seed: int = 7):
    """Every model x a seeded sample of settings (the full product is thousands of loads), plus, for each model,
    flash attention off and on at a large context (where the kq scores dominate)."""
    rng = random.Random(seed)
    contexts = (256, 300, 1000, 2000, 4096, 0)
    batches = ((2048, 512), (64, 64), (300, 100), (1024, 256), (512, 512))
    types = (("f16", "f16"), ("f32", "bf16"), ("q8_0", "q8_0"), ("q4_0", "f16"), ("q8_0", "q4_0"), ("bf16", "q5_1"))
    layouts = ((1, False), (3, False), (3, True), (2, False), (4, True))
    grid = list(itertools.product(contexts, batches, types, ("on", "off"), layouts, (False, True)))
    cases = []
    for model in list(MODELS) + ["llama-bigvocab"]:
        for fa in ("off", "on"):
            cases.append((model, LlamaCppOptions(n_ctx=4096, flash_attn=fa)))
        for c, (b, ub), (tk, tv), fa, (np_, unified), swa_full in rng.sample(grid, 6):
            cases.append((model, LlamaCppOptions(n_ctx=c, n_batch=b, n_ubatch=ub, type_k=tk, type_v=tv, flash_attn=fa,
                                                 n_seq_max=np_, kv_unified=unified, swa_full=swa_full)))
    return cases


def _id(case):
    model, o = case
    return (f"{model}-c{o.n_ctx}-b{o.n_batch}-ub{o.n_ubatch}-{o.type_k}-{o.type_v}-fa{o.flash_attn}-np{o.n_seq_max}"
            f"{'u' if o.kv_unified else ''}{'-swafull' if o.swa_full else ''}")


def _mib(n: int) -> float:
    return float(f"{n / MIB:.2f}")


@pytest.mark.parametrize("case", _matrix(), ids=_id)
def test_compute_and_output_buffers_equal_llamacpps(case, gguf_files):
    model, options = case
    path = gguf_files[model]
    try:
        predicted = plan(read_gguf(path), options)
    except SettingsError:
        with pytest.raises(SettingsError):
            observe_buffers(path, options)  # llama.cpp refuses the same context (KV rules: tests/test_llamacpp.py)
        return
    seen = observe_buffers(path, options)
    assert seen.compute_bytes is not None, "llama_get_memory_breakdown is not exported by this libllama"
    assert predicted.compute_bytes == seen.compute_bytes, (
        f"compute buffer: predicted {predicted.compute_bytes:,} B, llama.cpp reserved {seen.compute_bytes:,} B "
        f"(graphs {predicted.compute.graphs})")
    assert _mib(predicted.compute_bytes) == seen.compute_mib
    assert _mib(predicted.output_bytes) == seen.output_mib
    assert seen.context_bytes == predicted.kv_bytes  # the same breakdown's KV: the reader reads the right fields


def test_output_buffer_grows_with_sequences(gguf_files):
    """output_reserve(n_seq_max): n_vocab x n_seq_max x 4 B, each figure as llama.cpp logs it."""
    path = gguf_files["llama-bigvocab"]
    for np_ in (1, 2, 5):
        options = LlamaCppOptions(n_ctx=1024, n_seq_max=np_)
        predicted = plan(read_gguf(path), options)
        assert predicted.output_bytes == BIG_VOCAB * np_ * 4
        assert observe_buffers(path, options).output_mib == _mib(predicted.output_bytes) > 0


def test_flash_attention_moves_the_compute_buffer(gguf_files):
    """The issue's case: with flash attention off the prompt graph holds n_kv x n_ubatch x n_head f32 scores; on,
    it does not. The prediction moves by what llama.cpp's buffer moves, at every context."""
    path = gguf_files["llama-gqa"]
    g = read_gguf(path)
    for n_ctx in (1024, 4096):
        off, on = (plan(g, LlamaCppOptions(n_ctx=n_ctx, flash_attn=fa)) for fa in ("off", "on"))
        seen_off, seen_on = (observe_buffers(path, LlamaCppOptions(n_ctx=n_ctx, flash_attn=fa)) for fa in ("off", "on"))
        assert off.compute_bytes - on.compute_bytes == seen_off.compute_bytes - seen_on.compute_bytes
        assert off.compute_bytes > n_ctx * 512 * 4 * 4 > on.compute_bytes  # the kq scores: n_kv x 512 x 4 heads x 4 B


def test_breakdown_reader_sees_the_model_and_the_cache(gguf_files):
    """llama_get_memory_breakdown read through ctypes: model bytes are the file's tensors, context bytes the KV."""
    from kvscope.core.runtimes.llamacpp.live import LlamaCppContext

    path = gguf_files["llama-mha-untied"]
    options = LlamaCppOptions(n_ctx=512)
    with LlamaCppContext(path, options) as ctx:
        rows = memory_breakdown(ctx.ctx)
    g = read_gguf(path)
    assert sum(r[0] for r in rows) == g.weight_bytes == plan(g, options).model_buffers["cpu_build_cpu"]
    assert sum(r[1] for r in rows) == plan(g, options).kv_bytes
    # a GPU build's split: every tensor on one side or the other, the tied copy on top (not checkable here)
    split = plan(g, LlamaCppOptions(n_ctx=512, n_gpu_layers=2)).model_buffers
    assert split["gpu_build_gpu"] + split["gpu_build_cpu"] == g.weight_bytes  # untied: no second copy


def test_calc_json_rows_carry_the_buffers(gguf_files, capsys):
    from kvscope import main

    path = gguf_files["gemma3-swa"]
    for fa in ("off", "on"):
        assert main.main(["calc", "--model", str(path), "--runtime", "llama.cpp", "--context", "4096",
                          "--flash-attn", fa, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        row = out["rows"][0]
        seen = observe_buffers(path, LlamaCppOptions(n_ctx=4096, flash_attn=fa))
        assert row["compute_buffer_bytes"] == seen.compute_bytes
        assert row["output_buffer_bytes"] == read_gguf(path).n_vocab * 4
        assert row["total_bytes"] == (row["weights_bytes"] + row["kv_cache_bytes"] + row["compute_buffer_bytes"]
                                      + row["output_buffer_bytes"])
        assert "not checked" in out["compute_buffer_note"]
    assert main.main(["calc", "--model", str(path), "--runtime", "llama.cpp", "--context", "4096",
                      "--flash-attn", "off"]) == 0
    table = capsys.readouterr().out
    assert "compute buffer" in table and "CUDA and Metal" in table


def test_an_architecture_not_replayed_is_unknown_not_zero(capsys):
    """A graph KV Scope does not replay (here DeepSeek-V3's, MLA with experts, from its config): the compute buffer
    is n/a in the table, null in the JSON, and so is the total: unknown, never a guess and never 0."""
    from kvscope import main

    assert main.main(["calc", "--model", "deepseek-v3", "--runtime", "llama.cpp", "--context", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["rows"][0]
    assert row["compute_buffer_bytes"] is None and row["total_bytes"] is None and row["kv_cache_bytes"] > 0
    assert out["llama_cpp"][0]["compute_buffer_note"]  # the reason
    assert main.main(["calc", "--model", "deepseek-v3", "--runtime", "llama.cpp", "--context", "4096"]) == 0
    assert "compute buffer: n/a" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# The fit: llama.cpp's --fit (common/fit.cpp) on one GPU, with KV Scope's projected bytes


def test_fit_keeps_what_fits_and_lowers_layers_when_it_does_not(gguf_files):
    g = read_gguf(gguf_files["llama-mha-untied"])
    options = LlamaCppOptions(n_ctx=4096, flash_attn="off")
    p = plan(g, options)
    everything = p.weights_gpu + p.kv_gpu_bytes + p.compute_bytes
    margin = 1 << 20
    roomy = fit_llamacpp(g, options, everything + margin, target_margin=margin)
    assert roomy.n_gpu_layers == g.n_layer_all + 1 and roomy.projected == everything
    tight = fit_llamacpp(g, options, everything + margin - 1, target_margin=margin)
    assert tight.n_gpu_layers < g.n_layer_all + 1 and tight.projected <= tight.target
    # one more layer would not have fit: the fit is the largest -ngl under the target
    more = plan(g, LlamaCppOptions(n_ctx=4096, flash_attn="off", n_gpu_layers=tight.n_gpu_layers + 1))
    assert more.weights_gpu + more.kv_gpu_bytes + more.compute_bytes > tight.target


def test_fit_interpolates_the_context_only_when_it_is_not_given(gguf_files):
    """-c 0: between --fit-ctx (4,096) and the trained context, on the projected bytes, rounded down to 256."""
    g = read_gguf(gguf_files["gemma3-swa"])  # trained context 4,096 in the tiny file: use a larger one
    big = gguf_models.llama(gguf_files["gemma3-swa"].parent / "long.gguf", ctx_train=65536)
    g = read_gguf(big)
    auto = LlamaCppOptions(n_ctx=0, flash_attn="on")
    at = {n: plan(g, LlamaCppOptions(n_ctx=n, flash_attn="on")) for n in (4096, 65536)}
    used = {n: p.weights_gpu + p.kv_gpu_bytes + p.compute_bytes for n, p in at.items()}
    margin = 1 << 20
    free = (used[4096] + used[65536]) // 2 + margin
    fit = fit_llamacpp(g, auto, free, target_margin=margin)
    expected = 4096 + (65536 - 4096) * (free - margin - used[4096]) // (used[65536] - used[4096])
    assert fit.n_ctx == expected - expected % 256 and fit.n_gpu_layers == g.n_layer_all + 1
    given = fit_llamacpp(g, LlamaCppOptions(n_ctx=65536, flash_attn="on"), free, target_margin=margin)
    assert given.n_ctx == 65536 and given.n_gpu_layers < g.n_layer_all + 1  # a given -c stays; layers go instead


def test_settled_mark_equals_the_whole_graphs():
    """The speed-up (the mark taken on shorter models of the same repeated layers until it settles) changes no
    figure: the whole graph's replay agrees on a generated set of deep shapes, settings and both attention paths."""
    from kvscope.core.prediction.llamacpp_compute import CacheGeom, GraphShape, _with_rotation, reserve_graphs

    rng = random.Random(11)
    for _ in range(16):
        n_layer = rng.randint(8, 40)
        pattern = rng.choice((0, 2, 4, 6))  # 0: no window layers
        swa = tuple(bool(pattern) and (il + 1) % pattern != 0 for il in range(n_layer))
        head, n_head = rng.choice((64, 128)), rng.choice((4, 8))
        n_head_kv = rng.choice((1, 2, n_head))
        shape = GraphShape(rng.choice(("llama", "gemma3")), n_layer, head * n_head, (n_head,) * n_layer,
                           (n_head_kv,) * n_layer, (head,) * n_layer, (head,) * n_layer, (rng.choice((512, 1024)),) * n_layer,
                           rng.choice((1000, 32000)), swa, (True,) * n_layer)
        fa = rng.random() < 0.5
        n_seqs = rng.choice((1, 2, 4))
        cells = rng.choice((512, 2048, 8192))
        tk = rng.choice(("f16", "q8_0")) if fa else "f16"
        caches = {"full": CacheGeom(cells, n_seqs, tk, tk, not fa, head * n_head_kv)}
        if pattern:
            caches["swa"] = CacheGeom(min(cells, 1024), n_seqs, tk, tk, not fa, head * n_head_kv)
        caches = {k: _with_rotation(shape, k, c) for k, c in caches.items()}
        args = (shape, rng.choice((64, 512)), n_seqs, 2048, fa, False, caches)
        assert reserve_graphs(*args, shorten=True) == reserve_graphs(*args, shorten=False)


def test_calc_gpu_memory_answers_with_the_total_and_llamacpps_fit(gguf_files, capsys):
    """calc --gpu-memory: the largest context is the one whose weights + KV + compute buffer on the GPU fit (one more
    256-cell step does not), and the JSON carries --fit's -c / -ngl for the given context and for -c 0."""
    from kvscope import main
    from kvscope.core.prediction.llamacpp import gpu_bytes

    path = gguf_files["llama-mha-untied"]
    g = read_gguf(path)
    memory = 48 << 20
    assert main.main(["calc", "--model", str(path), "--runtime", "llama.cpp", "--context", "2048", "--flash-attn",
                      "off", "--gpu-memory", str(memory), "--fit-target", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    n = out["max_context"]
    at = plan(g, LlamaCppOptions(n_ctx=n, flash_attn="off"))
    beyond = plan(g, LlamaCppOptions(n_ctx=n + 1, flash_attn="off"))
    assert gpu_bytes(at, 0) <= memory < gpu_bytes(beyond, 0)
    assert at.compute_bytes > 0 and gpu_bytes(at, 0) == at.weights_gpu + at.kv_gpu_bytes + at.compute_bytes
    fit = out["fit"]  # 48 MiB less a 16 MiB --fit-target: every layer at -c 2048 (about 26 MiB)
    expected = plan(g, LlamaCppOptions(n_ctx=2048, flash_attn="off"))
    assert fit["target_bytes"] == memory - (16 << 20) and fit["n_ctx"] == 2048
    assert fit["n_gpu_layers"] == g.n_layer_all + 1 and fit["projected_bytes"] == gpu_bytes(expected, 0)
    auto = out["fit_context_auto"]  # -c 0: the trained 2,048 fits too, nothing changes
    assert auto["n_ctx"] == g.n_ctx_train and auto["n_gpu_layers"] == g.n_layer_all + 1
