"""GGUF files as a model source (kvscope.core.model.gguf), the llama.cpp rules that need no llama.cpp (kvscope.core.prediction.llamacpp), and the
embedded model's conversion (kvscope.core.model.gguf_write). Needs only the gguf package, a dependency: runs everywhere."""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest

from kvscope.core.model.attention import SettingsError
from kvscope.core.model.gguf import is_gguf_source, read_gguf
from kvscope.core.model.sources import load_spec
from kvscope.core.model.spec import SpecError
from kvscope.core.prediction.llamacpp import LlamaCppOptions, plan, row_bytes
from tests import gguf_models


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-src")
    return {"llama": gguf_models.llama(root / "llama.gguf"), "gemma3": gguf_models.gemma3(root / "gemma3.gguf"),
            "ds2": gguf_models.deepseek2(root / "ds2.gguf"),
            "untied": gguf_models.llama(root / "untied.gguf", tied=False, n_layer=3)}


def test_header_facts(files):
    g = read_gguf(files["llama"])
    assert (g.arch, g.n_layer, g.n_embd, g.n_head, g.n_head_kv, g.head_k, g.n_ctx_train) == (
        "llama", 2, 128, (4, 4), (2, 2), 32, 2048)
    assert g.weight_bytes == sum(a.nbytes for a in _arrays(g)) and g.bytes_by_type() == {"F16": 666_624, "F32": 2 * 2 * 128 * 4 + 128 * 4}
    s = g.spec()
    assert (s.num_layers, s.num_query_heads, s.num_kv_heads, s.head_dim, s.tie_word_embeddings) == (2, 4, 2, 32, True)
    assert s.num_parameters == g.parameters and load_spec(str(files["llama"])).num_parameters == g.parameters
    assert not read_gguf(files["untied"]).spec().tie_word_embeddings
    w = read_gguf(files["gemma3"])
    # llama.cpp's gemma3 pattern: every 6th layer full, the others windowed (src/models/gemma3.cpp load_swa_pattern(ml, 6)).
    assert w.is_swa == (True, True, True, True, True, False, True) and w.n_swa == 128
    assert w.spec().sliding_window == 128 and w.spec().num_sliding_layers == 6
    m = read_gguf(files["ds2"])
    assert m.is_mla and (m.kv_lora_rank, m.n_rot, m.head_k_mla, m.head_v_mla) == (64, 32, 64, 32)
    assert m.spec().is_mla and m.spec().kv_lora_rank == 64


def _arrays(g):
    from gguf import GGUFReader

    return [t.data for t in GGUFReader(str(g.path)).tensors]


def test_transformers_calc_reads_a_gguf(files, capsys):
    from kvscope import main

    assert main.main(["calc", "--model", str(files["llama"]), "--context", "1000", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    # transformers' DynamicCache of this model in fp16 (a GGUF's weights load as fp16): 2 x 2 layers x 2 heads x 32 x 2 B.
    assert row["kv_cache_bytes"] == 2 * 2 * 2 * 32 * 2 * 1000


def test_untrusted_files_are_refused_with_a_reason(tmp_path, files):
    assert is_gguf_source(str(files["llama"])) and not is_gguf_source("llama-3-8b")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(SpecError, match="not a GGUF file"):
        read_gguf(bad)
    with pytest.raises(SpecError, match="no such file"):
        load_spec(str(tmp_path / "missing.gguf"))
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(SpecError, match="not a regular file"):
        read_gguf(tmp_path / "dir.gguf")
    data = files["llama"].read_bytes()
    rng = random.Random(14)
    for i in range(60):  # truncations and flipped bytes of a real file: a SpecError, never another exception
        cut = bytearray(data[: rng.randrange(4, len(data))]) if i % 2 else bytearray(data)
        for _ in range(rng.randrange(1, 8)):
            pos = rng.randrange(4, min(len(cut), 4096))
            cut[pos] = rng.randrange(256)
        f = tmp_path / f"fuzz{i}.gguf"
        f.write_bytes(bytes(cut))
        try:
            g = read_gguf(f)
        except SpecError as exc:
            assert str(exc)
            continue
        g.spec()  # what does parse is usable or refused
    # An absurd count in an otherwise valid header.
    huge = tmp_path / "huge.gguf"
    gguf_models.llama(huge)
    raw = bytearray(huge.read_bytes())
    key = b"llama.block_count"
    at = raw.index(key) + len(key)
    value_type, = struct.unpack_from("<I", raw, at)
    assert value_type == 4  # uint32
    struct.pack_into("<I", raw, at + 4, 4_000_000_000)
    huge.write_bytes(bytes(raw))
    with pytest.raises(SpecError, match="block_count"):
        read_gguf(huge)


def test_llamacpp_rules_from_the_source():
    """The arithmetic of src/llama-context.cpp and src/llama-kv-cache-iswa.cpp on a preset (no llama.cpp needed)."""
    spec = load_spec("llama-3-8b")
    p = plan(spec, LlamaCppOptions(n_ctx=4096))
    assert p.kv_bytes == 536_870_912  # 128 KiB per token x 4096, the article's figure
    assert plan(spec, LlamaCppOptions(n_ctx=4000)).n_ctx == 4096  # padded to 256
    par = plan(spec, LlamaCppOptions(n_ctx=4096, n_seq_max=3))
    assert (par.n_ctx_seq, par.buffers[0].streams, par.n_ctx) == (1536, 3, 4608)  # pad(4096 / 3) x 3
    uni = plan(spec, LlamaCppOptions(n_ctx=4096, n_seq_max=3, kv_unified=True))
    assert (uni.n_ctx_seq, uni.buffers[0].streams, uni.kv_bytes) == (4096, 1, 536_870_912)
    q8 = plan(spec, LlamaCppOptions(n_ctx=4096, type_k="q8_0", type_v="q8_0", flash_attn="on"))
    assert q8.kv_bytes == 32 * 2 * row_bytes("q8_0", 8 * 128) * 4096 == 32 * 2 * 1088 * 4096
    with pytest.raises(SettingsError, match="needs flash attention"):
        plan(spec, LlamaCppOptions(type_v="q4_0", flash_attn="off"))
    with pytest.raises(SettingsError, match="unknown llama.cpp cache type"):
        LlamaCppOptions(type_k="q3_k")
    # -ngl: the output layer first, then the last layers (load_tensors' i_gpu_start = n_layer + 1 - ngl).
    assert plan(spec, LlamaCppOptions(n_gpu_layers=1)).gpu_layers == ()
    assert plan(spec, LlamaCppOptions(n_gpu_layers=3)).gpu_layers == (30, 31)
    assert plan(spec, LlamaCppOptions(n_gpu_layers=3)).kv_gpu_bytes == 2 * 2 * 8 * 128 * 2 * 4096
    assert plan(spec, LlamaCppOptions(n_gpu_layers=3, offload_kqv=False)).kv_gpu_bytes == 0
    gemma = load_spec("gemma-3-27b") if "gemma-3-27b" in _presets() else None
    if gemma is not None and gemma.num_sliding_layers:
        g = plan(gemma, LlamaCppOptions(n_ctx=32768))
        assert g.buffers[1].cells == 1024 + 512 and g.buffers[1].window == gemma.sliding_window  # pad(1024 + 512)


def _presets():
    from kvscope.core.model.spec import preset_names

    return preset_names()


def test_embedded_model_converts_to_gguf(tmp_path, monkeypatch):
    """The embedded model as a GGUF: every weight, Q and K rows permuted for llama.cpp's rotary layout, fp16."""
    from safetensors.numpy import load_file

    from kvscope.core.model.embedded import embedded_model_dir
    from kvscope.core.model.gguf_write import _permute, export_llama_folder

    folder = embedded_model_dir()
    out = export_llama_folder(folder, tmp_path / "e.gguf")
    g = read_gguf(out)
    spec = load_spec("embedded")
    assert (g.n_layer, g.n_head, g.n_head_kv, g.head_k, g.n_vocab) == (4, (8,) * 4, (8,) * 4, 32, 1024)
    assert g.parameters == spec.num_parameters  # tied: the embedding once, as the model holds it
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(out)).tensors}
    state = load_file(str(folder / "model.safetensors"))
    q = state["model.layers.0.self_attn.q_proj.weight"]
    got = np.asarray(tensors["blk.0.attn_q.weight"].data).reshape(q.shape)
    assert np.array_equal(got, _permute(q, 8).astype(np.float16))
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"


def test_the_calculator_and_calc_agree_on_what_fits(files):
    """One rule for "the largest context that fits" (llama.cpp's -ngl all: every weight but the token embedding,
    plus a tied output's copy of it, and the KV): the calculator tab and calc --runtime llama.cpp --gpu-memory."""
    from kvscope.core.prediction.llamacpp import calculate_llamacpp, max_context_llamacpp, predict_llamacpp

    for name in ("untied", "llama"):
        spec = load_spec(str(files[name]))
        g = read_gguf(files[name])
        embd = next(t.n_bytes for t in g.tensors if t.name == "token_embd.weight")
        on_gpu = g.weight_bytes - (embd if name == "untied" else 0)
        assert predict_llamacpp(spec, 1024).breakdown.weights == on_gpu
        for memory in (3 << 20, 5 << 20, 9 << 20):
            cli = calculate_llamacpp(str(files[name]), spec, [1024], lambda n: LlamaCppOptions(n_ctx=n), memory)
            assert cli.max_context == max_context_llamacpp(spec, memory) is not None
            assert predict_llamacpp(spec, cli.max_context).total <= memory < predict_llamacpp(spec, cli.max_context + 256).total


def test_the_readers_type_tables_are_the_gguf_packages():
    """kvscope.core.model.gguf reads a header without the gguf package (no numpy, no memory map of every array); its tables of
    ggml types (block size, bytes per block) and file types are llama.cpp's own gguf-py's, entry for entry."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

    from kvscope.core.model.gguf import FILE_TYPES, GGML_TYPES

    assert GGML_TYPES == {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType}
    assert FILE_TYPES == {int(t): t.name.removeprefix("MOSTLY_") for t in LlamaFileType if t.name != "GUESSED"}


def test_the_bounded_reader_reads_what_the_gguf_package_reads(files, tmp_path):
    """Every tensor (name, type, shape, bytes) and every hyperparameter the predictor uses, as llama.cpp's gguf-py
    GGUFReader parses them element by element, for the tiny models of every cache layout, a quantized one and the
    embedded model's conversion."""
    from gguf import GGUFReader

    from kvscope.core.model.embedded import embedded_model_dir
    from kvscope.core.model.gguf_write import export_llama_folder

    paths = dict(files, q8=gguf_models.llama(tmp_path / "q8.gguf", quant="q8_0", n_layer=3),
                 embedded=export_llama_folder(embedded_model_dir(), tmp_path / "e.gguf"))
    for name, path in paths.items():
        g = read_gguf(path)
        ref = GGUFReader(str(path))
        assert [(t.name, t.ggml_type, t.shape, t.n_bytes) for t in g.tensors] == [
            (t.name, t.tensor_type.name, tuple(int(x) for x in t.shape), int(t.n_bytes)) for t in ref.tensors], name
        fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
        arch = fields["general.architecture"]
        assert (g.arch, g.name, g.n_layer_all, g.n_embd, g.n_ctx_train) == (
            arch, fields["general.name"], fields[f"{arch}.block_count"], fields[f"{arch}.embedding_length"],
            fields[f"{arch}.context_length"]), name
        assert g.n_head == (fields[f"{arch}.attention.head_count"],) * g.n_layer_all, name
        assert g.n_head_kv == (fields.get(f"{arch}.attention.head_count_kv", g.n_head[0]),) * g.n_layer_all, name
        assert g.n_vocab == fields.get(f"{arch}.vocab_size", len(fields["tokenizer.ggml.tokens"])), name
        assert g.weight_bytes == sum(int(t.n_bytes) for t in ref.tensors)
