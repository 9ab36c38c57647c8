"""A flash-attention toggle in a live llama.cpp run: ``attn-impl=fa-on`` / ``fa-off`` reloads the context with the
other ``-fa`` and re-runs the tokens, and the compute buffer moves.

The real llama.cpp runs the embedded model's GGUF at -c 4096. Every sample carries the compute buffer llama.cpp
reserved (``activations_observed``: exact bytes from its own ``llama_get_memory_breakdown``) and the replay's
prediction (``activations_predicted``: kvscope.core.prediction.llamacpp_compute); they are equal at every sample, before and after
each switch, and the buffer with flash attention off is larger (the n_kv x n_tokens scores it materialises).
"""

from __future__ import annotations

import dataclasses

import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="the llamacpp extra (make test installs it)")

from kvscope.core.base.sample import Sample  # noqa: E402
from kvscope.core.base.sample import sample_from_json  # noqa: E402
from kvscope.core.live.breakdown import MEASURED, memory_breakdown  # noqa: E402
from kvscope.core.live.run import run_generation  # noqa: E402
from kvscope.core.model.gguf import read_gguf  # noqa: E402
from kvscope.core.model.gguf_write import embedded_gguf  # noqa: E402
from kvscope.core.model.request import RunHooks, RunRequest  # noqa: E402
from kvscope.core.prediction.llamacpp import LlamaCppOptions, plan  # noqa: E402
from kvscope.core.records.recording import sample_from_json  # noqa: E402
from kvscope.core.runtimes.llamacpp.engine import FIXED_LAYOUT, RUNTIME  # noqa: E402


def _run(request: RunRequest) -> list[Sample]:
    samples: list[Sample] = []
    run_generation(dataclasses.replace(request, runtime=RUNTIME), RunHooks(emit=samples.append))
    return samples


def test_flash_attention_toggles_reload_and_move_the_compute_buffer_as_predicted():
    path = embedded_gguf()
    options = LlamaCppOptions(n_ctx=4096, flash_attn="off")
    g = read_gguf(path)
    predicted = {fa: plan(g, dataclasses.replace(options, flash_attn=fa)).compute_bytes for fa in ("off", "on")}
    assert None not in predicted.values()
    switches = ((4, "attn-impl", "fa-on"), (9, "attn-impl", "fa-off"), (12, "attn-impl", "xformers"),
                (14, "attention", "mqa"), (16, "attn-impl", "fa-off"))
    samples = _run(RunRequest(runtime="llama.cpp", options={"llama.cpp": options}, max_new_tokens=20, switches=switches))

    done = [s for s in samples if s.event == "switch"]
    assert [(s.switch_key, s.switch_before, s.switch_after) for s in done] == [
        ("attn-impl", "fa-off", "fa-on"), ("attn-impl", "fa-on", "fa-off")]
    assert all(s.tokens_rerun == s.context_tokens > 4 for s in done)
    refused = [s for s in samples if s.event == "refused"]
    assert [s.switch_key for s in refused] == ["attn-impl", "attention"]
    assert "fa-on" in refused[0].text and FIXED_LAYOUT in refused[1].text
    notes = [s for s in samples if s.event == "note" and s.switch_key == "attn-impl"]
    assert len(notes) == 1 and "already fa-off" in notes[0].text

    decodes = [s for s in samples if s.phase == "decode"]
    assert len(decodes) == 20  # the run went on through both reloads and the refusals
    measured = [s for s in samples if s.event != "error" and s.runtime == "llama.cpp"]
    for s in measured:  # every sample: the prefill, each token, each event
        fa = s.attn_impl.removeprefix("fa-")
        assert s.activations_observed is not None, s
        assert s.activations_observed == s.activations_predicted == predicted[fa], (s.token, s.event, fa)
    impl = {s.token: s.attn_impl for s in decodes}
    assert impl[1] == "fa-off" and impl[6] == "fa-on" and impl[12] == "fa-off" and impl[20] == "fa-off"
    on = {s.activations_observed for s in decodes if s.attn_impl == "fa-on"}
    off = {s.activations_observed for s in decodes if s.attn_impl == "fa-off"}
    assert len(on) == len(off) == 1 and off.pop() > on.pop(), "flash attention off holds the scores: a larger buffer"
    # the KV does not move with -fa for an f16 cache: the same reservation before and after
    assert len({s.kv_bytes_reserved for s in decodes}) == 1
    assert f"{predicted['on']:,} B" in done[0].text and f"{predicted['off']:,} B" in done[0].text

    # where the memory went: the compute buffer is the activations, measured
    for s in (decodes[0], decodes[6], decodes[-1]):
        part = memory_breakdown(s).part("activations")
        assert part.source == MEASURED and part.bytes == s.activations_observed
    # and it survives a recording's reader
    again = sample_from_json(decodes[6].to_dict())
    assert again.activations_observed == decodes[6].activations_observed
