"""Where the memory went (kvscope.core.live.breakdown), without Qt: generated samples of every kind of device, a real
reading of this process, and the Prometheus page that publishes the same parts."""

from __future__ import annotations

import random
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.core.base.sample import Sample
from kvscope.core.live.breakdown import (MEASURED, NA, PARTS, PREDICTED, REMAINDER, comparable_totals,
                                         forward_peak_totals, memory_breakdown)
from kvscope.core.live.metrics import MetricsExporter, RunCollector
from kvscope.core.runtimes.probes import MemoryProbe

MiB = 1 << 20


def _sample(**kw) -> Sample:
    base = dict(token=3, phase="decode", time_s=0.5, text="x", attention="mha", attn_impl="sdpa", cache="dynamic",
                kernel="sdpa-math", device="cpu", dtype="float32", kv_bytes_storage=None, weights_bytes=None)
    base.update(kw)
    return Sample(**base)


def _gpu_sample(rng: random.Random) -> Sample:
    """A consistent CUDA reading: weights + KV + transients <= allocated <= reserved <= process <= device."""
    weights, held = rng.randint(1, 4000) * MiB, rng.randint(0, 900) * MiB
    reserved_kv = held + rng.choice([0, rng.randint(1, 300) * MiB])
    allocated = weights + reserved_kv + rng.randint(0, 200) * MiB
    pool = allocated + rng.randint(0, 500) * MiB
    process = pool + rng.randint(300, 700) * MiB  # the CUDA context and kernels
    used = process + rng.choice([0, rng.randint(1, 9000) * MiB])  # other processes, or none
    return _sample(device="cuda:0", weights_bytes=weights, kv_bytes_held=held, kv_bytes_reserved=reserved_kv,
                   allocator_allocated=allocated, allocator_reserved=pool, allocator_peak=allocated + MiB,
                   process_gpu=process, device_used=used, device_total=used + MiB,
                   activations_predicted=rng.randint(0, 99) * MiB, total_predicted=allocated)


def test_a_gpu_total_is_split_into_measured_parts_exactly() -> None:
    """Generated CUDA samples: every part measured, none negative, and they add up to NVML's device used."""
    rng = random.Random(24)
    for _ in range(300):
        s = _gpu_sample(rng)
        b = memory_breakdown(s)
        assert b.total == s.device_used and b.total_source == "device used (NVML)"
        assert [p.name for p in b.parts] == list(PARTS)
        assert all(p.source == MEASURED and p.bytes is not None and p.bytes >= 0 for p in b.parts), b
        assert b.unattributed == 0
        assert b.part("allocator_cache").bytes == s.allocator_reserved - s.allocator_allocated
        assert b.part("other_processes").bytes == s.device_used - s.process_gpu
        assert b.part("kv_reserved_free").bytes == s.kv_bytes_reserved - s.kv_bytes_held


def test_what_a_device_does_not_say_is_na_never_zero() -> None:
    """NVML without a per-process figure (WSL): the runtime and the other processes are n/a, and what the known
    parts leave of the total is said, not spread over them."""
    rng = random.Random(7)
    for _ in range(100):
        s = _gpu_sample(rng).replace(process_gpu=None)
        b = memory_breakdown(s)
        for name in ("runtime", "other_processes"):
            assert b.part(name).bytes is None and b.part(name).source == NA
        assert b.unattributed == s.device_used - s.allocator_reserved
    nothing = memory_breakdown(_sample())
    assert nothing.total is None and nothing.unattributed is None
    assert all(p.bytes is None and p.source == NA for p in nothing.parts)


def test_a_cpu_run_measures_what_it_can_and_predicts_the_rest() -> None:
    """The real resident set of this process as the total; walked weights and KV measured, activations the
    prediction's, the runtime what the RSS leaves (never negative), the allocator cache and other processes n/a."""
    reading = MemoryProbe("cpu").read()
    assert reading.process_rss is not None and reading.allocator_allocated is None
    weights, kv, act = reading.process_rss // 4, reading.process_rss // 8, reading.process_rss // 16
    s = _sample(process_rss=reading.process_rss, weights_bytes=weights, kv_bytes_held=kv, kv_bytes_reserved=kv,
                activations_predicted=act)
    b = memory_breakdown(s)
    assert b.total == reading.process_rss and b.total_source == "process RSS"
    assert (b.part("weights").source, b.part("kv_held").source) == (MEASURED, MEASURED)
    assert b.part("activations").source == PREDICTED and b.part("activations").bytes == act
    assert b.part("runtime").source == REMAINDER
    assert b.part("runtime").bytes == reading.process_rss - weights - kv - act
    assert b.part("allocator_cache").bytes is None and b.part("other_processes").bytes is None
    assert b.unattributed == 0
    # figures read at different instants can disagree: a part is then n/a, not negative
    tight = memory_breakdown(s.replace(weights_bytes=reading.process_rss))
    assert tight.part("runtime").bytes is None and tight.part("runtime").source == NA


def test_llamacpp_prepayment_is_held_plus_reserved_free() -> None:
    s = _sample(runtime="llama.cpp", kv_bytes_held=3 * MiB, kv_bytes_reserved=16 * MiB, weights_bytes=40 * MiB,
                process_rss=300 * MiB)
    b = memory_breakdown(s)
    assert b.part("kv_held").bytes == 3 * MiB and b.part("kv_reserved_free").bytes == 13 * MiB


def test_totals_are_compared_like_with_like() -> None:
    """CUDA: the step's allocator peak against weights + KV + activation peak; the CPU: weights + KV on both sides
    (never the RSS); a measured forward pass (prefill, re-run): weights + its peak on both sides."""
    rng = random.Random(3)
    gpu = _gpu_sample(rng)
    assert comparable_totals(gpu) == (gpu.allocator_peak, gpu.total_predicted)
    cpu = _sample(process_rss=900 * MiB, weights_bytes=10 * MiB, kv_bytes_held=MiB, kv_bytes_reserved=MiB,
                  weights_predicted=10 * MiB, kv_bytes_predicted=MiB, total_predicted=12 * MiB)
    assert comparable_totals(cpu) == (11 * MiB, 11 * MiB)
    assert forward_peak_totals(cpu) is None
    prefill = cpu.replace(phase="prefill", peak_bytes_observed=3 * MiB, peak_bytes_predicted=3 * MiB - 12)
    assert forward_peak_totals(prefill) == (13 * MiB, 13 * MiB - 12)
    # a decode step's peak (measured now and then) sits above the cache it started from: not a Total-plot marker
    assert forward_peak_totals(prefill.replace(phase="decode")) is None
    # llama.cpp: its compute buffer read back from llama.cpp is compared with the predicted one, beside model + KV
    llama = cpu.replace(activations_observed=7 * MiB, activations_predicted=7 * MiB - 5, kv_bytes_reserved=2 * MiB,
                        kv_bytes_predicted=2 * MiB)
    assert comparable_totals(llama) == (19 * MiB, 19 * MiB - 5)
    # no allocator peak: never the allocated bytes after the step against a total that counts the step's peak
    after = gpu.replace(allocator_peak=None)
    assert comparable_totals(after)[0] == after.weights_bytes + after.kv_bytes_reserved


@pytest.mark.parametrize("seed", [1, 2])
def test_the_exporter_publishes_the_same_breakdown(seed: int) -> None:
    rng = random.Random(seed)
    s = _gpu_sample(rng).replace(phase="prefill", peak_bytes_observed=5 * MiB, peak_bytes_predicted=5 * MiB)
    collector = RunCollector(model="m", device="cuda:0")
    collector.observe(s)
    # a decode step: the breakdown follows it, the prefill's peak stays
    collector.observe(_gpu_sample(rng).replace(time_s=0.6))
    last = collector._last
    with MetricsExporter(collector) as exporter:
        with urllib.request.urlopen(exporter.url, timeout=2) as response:
            text = response.read().decode()
    page = {(x.name, tuple(sorted(x.labels.items()))): x.value
            for family in text_string_to_metric_families(text) for x in family.samples}
    b = memory_breakdown(last)
    for p in b.parts:
        assert page[("kvscope_memory_breakdown_bytes", (("part", p.name), ("source", p.source)))] == p.bytes
    assert page[("kvscope_memory_observed_total_bytes", (("source", b.total_source),))] == b.total
    assert page[("kvscope_forward_peak_observed_bytes", ())] == 5 * MiB
    # a part the device does not report is absent from the page
    collector.observe(_gpu_sample(rng).replace(process_gpu=None, time_s=0.7))
    with MetricsExporter(collector) as exporter:
        with urllib.request.urlopen(exporter.url, timeout=2) as response:
            text = response.read().decode()
    parts = {x.labels["part"] for family in text_string_to_metric_families(text) for x in family.samples
             if x.name == "kvscope_memory_breakdown_bytes"}
    assert parts == set(PARTS) - {"runtime", "other_processes"}
