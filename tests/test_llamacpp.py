"""KV Scope's llama.cpp predictor against the real llama.cpp (llama-cpp-python 0.3.36), byte for byte.

Tiny GGUF files of three cache layouts (tests/gguf_models.py: GQA llama, sliding-window gemma3, MLA
deepseek2) are loaded into llama.cpp under a generated matrix of context sizes, K/V cache types, flash
attention on/off, parallel sequences (split or unified) and full-size window caches. For each load:

- llama.cpp's own log lines (cells, layers, streams, types) equal the prediction's caches;
- the bytes per cell, measured from the state of one sequence one token apart, equal the prediction's;
- so the allocation (cells x streams x bytes per cell) is exact, and every MiB figure llama.cpp logs is the
  prediction rounded the way it rounds (%.2f);
- where llama.cpp refuses the context (a quantized V cache without flash attention), the predictor
  refuses too, with the reason.

Weights: the prediction is the file's tensor bytes, which equals what llama.cpp's loader reports.
"""

from __future__ import annotations

import itertools
import json

import pytest

from kvscope.core.model.attention import SettingsError
from kvscope.core.model.gguf import read_gguf
from kvscope.core.prediction.llamacpp import LlamaCppOptions, plan
from tests import gguf_models

llama_cpp = pytest.importorskip("llama_cpp", reason="the llamacpp extra (make test installs it)")

from kvscope.core.runtimes.llamacpp.live import MIB, LlamaCppContext, observe  # noqa: E402

MODELS = {
    "llama-gqa": lambda p: gguf_models.llama(p),
    "llama-mha-untied": lambda p: gguf_models.llama(p, n_head_kv=4, tied=False, n_layer=3),
    "llama-q8_0-weights": lambda p: gguf_models.llama(p, quant="q8_0"),
    "gemma3-swa": lambda p: gguf_models.gemma3(p),
    "deepseek2-mla": lambda p: gguf_models.deepseek2(p),
}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {name: make(root / f"{name}.gguf") for name, make in MODELS.items()}


def _matrix():
    """Each model x a generated spread of settings: every cache-type pair with flash on, the refusals with flash
    off, and every context size x sequence layout with f16."""
    contexts = (300, 1000, 4096, 0)
    types = (("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "f16"), ("f32", "bf16"), ("q8_0", "q4_0"))
    layouts = ((1, False), (3, False), (3, True), (2, False))
    cases = []
    for model in MODELS:
        for (tk, tv), fa in itertools.product(types, ("on", "off")):
            cases.append((model, LlamaCppOptions(n_ctx=1000, type_k=tk, type_v=tv, flash_attn=fa)))
        for n_ctx, (seqs, unified) in itertools.product(contexts, layouts):
            cases.append((model, LlamaCppOptions(n_ctx=n_ctx, n_seq_max=seqs, kv_unified=unified)))
        cases.append((model, LlamaCppOptions(n_ctx=1000, swa_full=True)))
        cases.append((model, LlamaCppOptions(n_ctx=2000, n_ubatch=64, n_batch=64)))
    return cases


def _id(case):
    model, o = case
    return (f"{model}-c{o.n_ctx}-np{o.n_seq_max}{'u' if o.kv_unified else ''}-{o.type_k}-{o.type_v}-fa{o.flash_attn}"
            f"{'-swafull' if o.swa_full else ''}-ub{o.n_ubatch}")


def _mib(n: int) -> float:
    return float(f"{n / MIB:.2f}")


@pytest.mark.parametrize("case", _matrix(), ids=_id)
def test_prediction_equals_llamacpp_allocation(case, gguf_files):
    model, options = case
    path = gguf_files[model]
    g = read_gguf(path)
    try:
        predicted = plan(g, options)
    except SettingsError as refused:
        with pytest.raises(SettingsError):
            LlamaCppContext(path, options).close()  # llama.cpp refuses the same context
        assert any(why in str(refused) for why in ("flash attention", "blocks of", "one cache type"))
        return
    seen = observe(path, options)
    assert [(c.cells, c.layers, c.streams, c.n_seq_max) for c in seen.caches] == [
        (b.cells, len(b.layers), b.streams, options.n_seq_max) for b in predicted.buffers], "caches differ"
    assert [(c.type_k, c.type_v) for c in seen.caches] == [(options.type_k, options.type_v)] * len(predicted.buffers)
    assert seen.bytes_per_cell == sum(b.row_bytes for b in predicted.buffers), "bytes per cell differ"
    assert seen.cell_bytes == tuple(b.row_bytes for b in predicted.buffers), "a cache's bytes per cell differ"
    for logged, b in zip(seen.caches, predicted.buffers):
        assert logged.size_mib == _mib(b.total), f"{b.name}: logged {logged.size_mib} MiB, predicted {b.total:,} B"
        assert logged.k_mib == _mib(b.k_bytes) and logged.v_mib == _mib(b.v_bytes)
    assert sum(mib for _, mib in seen.buffers) == pytest.approx(_mib(predicted.kv_bytes), abs=0.01 * len(seen.buffers))


def test_weights_are_the_files_tensor_bytes(gguf_files):
    """The loader's "file size" is the whole file; the tensors are all of it but the header and alignment."""
    for name, path in gguf_files.items():
        g = read_gguf(path)
        size = path.stat().st_size
        assert 0 < size - g.weight_bytes < 64 * 1024 + 32 * len(g.tensors), name  # header + vocab + padding only
        assert g.weight_bytes == sum(t.n_bytes for t in g.tensors)
        with LlamaCppContext(path, LlamaCppOptions(n_ctx=256)) as ctx:
            assert ctx._ll.llama_model_size(ctx.model) == g.weight_bytes, name  # llama.cpp's own sum of tensor bytes
            assert ctx._ll.llama_model_n_params(ctx.model) == g.parameters, name


def test_calc_cli_reports_llamacpps_bytes(gguf_files, capsys):
    """The issue's command: calc --runtime llama.cpp --context 4096 --cache-type-k q8_0 --cache-type-v q8_0
    --flash-attn on --json, equal to what llama.cpp allocates for that model and those settings."""
    from kvscope import main

    for name in ("llama-gqa", "gemma3-swa", "deepseek2-mla"):
        path = gguf_files[name]
        rc = main.main(["calc", "--model", str(path), "--runtime", "llama.cpp", "--context", "4096",
                        "--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "--flash-attn", "on", "--json"])
        assert rc == 0
        out = json.loads(capsys.readouterr().out)
        options = LlamaCppOptions(n_ctx=4096, type_k="q8_0", type_v="q8_0", flash_attn="on")
        seen = observe(path, options)
        row, caches = out["rows"][0], out["llama_cpp"][0]["caches"]
        assert row["context"] == 4096
        assert [(c["cells"], c["streams"], c["layers"]) for c in caches] == [(c.cells, c.streams, c.layers)
                                                                            for c in seen.caches]
        assert sum(c["bytes_per_cell"] for c in caches) == seen.bytes_per_cell
        assert row["kv_cache_bytes"] == sum(c["cells"] * c["streams"] * c["bytes_per_cell"] for c in caches)
        assert [_mib(c["k_bytes"] + c["v_bytes"]) for c in caches] == [c.size_mib for c in seen.caches]
        assert row["weights_bytes"] == read_gguf(path).weight_bytes


def test_llamacpp_refuses_what_the_predictor_refuses(gguf_files):
    options = LlamaCppOptions(n_ctx=512, type_v="q8_0", flash_attn="off")
    with pytest.raises(SettingsError, match="needs flash attention"):
        plan(read_gguf(gguf_files["llama-gqa"]), options)
    with pytest.raises(SettingsError, match="refused the context"):
        LlamaCppContext(gguf_files["llama-gqa"], options)


def test_the_buffer_never_grows(gguf_files):
    """The prepayment: what llama.cpp allocated at load is all it ever holds, at 1 token or at 500."""
    path = gguf_files["llama-gqa"]
    options = LlamaCppOptions(n_ctx=1024)
    predicted = plan(read_gguf(path), options)
    with LlamaCppContext(path, options) as ctx:
        ctx.decode([1], 0)
        assert ctx.used_cells() == 1
        for pos in range(1, 500, 50):
            ctx.decode([5] * 50, pos)
        assert ctx.used_cells() == 501
        assert predicted.used_bytes(501) == predicted.buffers[0].row_bytes * 501
        assert predicted.used_bytes(2000) == predicted.kv_bytes  # capped at the allocation


def test_embedded_gguf_generates_what_transformers_generates():
    """The embedded model's GGUF (kvscope.core.model.gguf_write) is the same model: same tokens for the prompt and the same 30
    greedy tokens through llama.cpp as through transformers (Q/K permuted right, the vocabulary and merges intact)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvscope.core.model.embedded import embedded_model_dir
    from kvscope.core.model.gguf_write import embedded_gguf

    folder = embedded_model_dir()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    prompt = "The KV cache"
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        hf = model.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1]:].tolist()
    llm = llama_cpp.Llama(model_path=str(embedded_gguf()), n_ctx=256, n_threads=1, verbose=False)
    try:
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        assert tokens == ids[0].tolist()
        out = []
        for t in llm.generate(tokens, temp=0.0, top_k=1):
            out.append(t)
            if len(out) == 30:
                break
    finally:
        llm.close()
    assert out == hf, (tok.decode(hf), tok.decode(out))


def test_run_takes_a_gguf_to_llamacpp_without_being_told(gguf_files, capsys):
    from kvscope import main

    assert main.main(["run", "--model", str(gguf_files["gemma3-swa"]), "--tokens", "2", "-c", "512"]) == 0
    out = capsys.readouterr().out
    expected = plan(read_gguf(gguf_files["gemma3-swa"]), LlamaCppOptions(n_ctx=512)).kv_bytes
    assert f"llama.cpp reserved {expected:,} B at load" in out
