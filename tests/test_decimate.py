"""Incremental peak decimation: the same picture as binning the whole column again, at any step."""

from __future__ import annotations

import numpy as np
import pytest

from kvscope.ui.decimate import PeakDecimator
from kvscope.ui.ringbuffer import RingBuffer


def reference(buf: RingBuffer, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Bin the whole held column from scratch, bins aligned to absolute row numbers."""
    x, y = buf.column("x"), buf.column("y")
    n = len(x)
    if n <= 2 * bins:
        return x, y
    size = 1 << int(np.ceil(np.log2(n / bins)))
    start = buf.appended - n
    out_x, out_y = [], []
    i = 0
    while i < n:
        j = min(n, i + size - (start + i) % size)  # to the next absolute bin edge
        chunk = y[i:j]
        out_x += [x[i], x[i]]
        finite = chunk[~np.isnan(chunk)]
        out_y += [finite.min(), finite.max()] if finite.size else [np.nan, np.nan]
        i = j
    return np.array(out_x), np.array(out_y)


@pytest.mark.parametrize("capacity", [50_000, 7_000])  # the second wraps many times
def test_matches_a_full_rebuild_at_every_step(capacity):
    rng = np.random.default_rng(1)
    buf = RingBuffer(capacity, ("x", "y"))
    dec = PeakDecimator(buf, "x", "y")
    row = 0
    for step in range(400):
        k = int(rng.integers(1, 200))
        y = rng.normal(size=k)
        y[rng.random(k) < 0.05] = np.nan  # not-available moments
        if step % 97 == 0:
            y[:] = np.nan  # a whole gap
        buf.extend_arrays({"x": np.arange(row, row + k, dtype=float), "y": y})
        row += k
        bins = 300 if step < 200 else 500  # the plot was resized
        got_x, got_y = dec.data(bins)
        want_x, want_y = reference(buf, bins)
        np.testing.assert_array_equal(got_x, want_x)
        np.testing.assert_array_equal(got_y, want_y)  # NaN == NaN here
    assert len(got_x) <= 2 * 500 + 4


def test_short_columns_are_drawn_exactly_and_clear_starts_over():
    buf = RingBuffer(100_000, ("x", "y"))
    dec = PeakDecimator(buf, "x", "y")
    buf.extend_arrays({"x": np.arange(100.0), "y": np.arange(100.0) * 2})
    x, y = dec.data(200)
    assert len(x) == 100 and y[-1] == 198.0
    buf.extend_arrays({"x": np.arange(100.0, 100_000.0), "y": np.arange(100.0, 100_000.0) * 2})
    x, y = dec.data(1000)
    assert len(x) <= 2 * 1000 + 4 and x[0] == 0 and y.max() == 2 * 99_999 and y.min() == 0
    buf.clear()
    buf.extend_arrays({"x": np.arange(10.0), "y": -np.arange(10.0)})
    x, y = dec.data(1000)
    np.testing.assert_array_equal(y, -np.arange(10.0))


def test_a_spike_inside_a_bin_survives():
    buf = RingBuffer(200_000, ("x", "y"))
    dec = PeakDecimator(buf, "x", "y")
    y = np.zeros(100_000)
    y[54_321] = 7.0
    buf.extend_arrays({"x": np.arange(100_000.0), "y": y})
    _, out = dec.data(800)
    assert out.max() == 7.0 and len(out) < 2_000
