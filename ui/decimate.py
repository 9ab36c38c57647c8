"""Incremental min/max ('peak') decimation of a growing ring-buffer column, for drawing.

A curve of 100,000 points is drawn at one or two points per pixel column. pyqtgraph's own 'peak'
downsampling recomputes every bin from the whole array at every frame (O(n) per curve per frame);
the live plots append a handful of points per frame, so here the finished bins are kept and only
the bins the new points touch are computed (O(new points) per frame; a full rebuild only when the
bin size doubles, which happens log2(n) times, or after the buffer is cleared).

Bins cover ``size`` consecutive rows by absolute row number (rows appended since the buffer was
cleared), so a bin's contents never change once it is full, even as the ring drops its oldest rows.
Each bin gives two points at its first row's x: its minimum, then its maximum (NaN, a gap, only
when every value in the bin is NaN). Columns short enough to draw as they are come back unchanged.
"""

from __future__ import annotations

import numpy as np

from kvscope.ui.ringbuffer import RingBuffer


def _peaks(x: np.ndarray, y: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bin ``len(x)`` rows (a multiple of ``size``) into (first x, min, max) per bin, NaN-aware."""
    rows = y.reshape(-1, size)
    return x[::size].copy(), np.fmin.reduce(rows, axis=1), np.fmax.reduce(rows, axis=1)


def _partial(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One bin made of the rows given (fewer than a full bin; at least one)."""
    return x[:1].copy(), np.fmin.reduce(y, keepdims=True), np.fmax.reduce(y, keepdims=True)


class PeakDecimator:
    """Draw-ready (x, y) for one (x column, y column) pair of a RingBuffer, at most ~2 x ``bins`` points."""

    def __init__(self, buffer: RingBuffer, x: str, y: str) -> None:
        self.buffer, self.x, self.y = buffer, x, y
        self._reset()

    def _reset(self) -> None:
        self.size = 0  # rows per bin; 0: not decimating (the column is drawn as it is)
        self._cleared = self.buffer.cleared
        self._first_bin = 0  # absolute bin number of the first kept full bin
        self._done = 0  # full bins kept, from _first_bin on
        self._bx = np.empty(0)
        self._bmin = np.empty(0)
        self._bmax = np.empty(0)

    def data(self, bins: int) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) to draw with about ``bins`` bins across the data (``bins`` ~ the plot's pixel width)."""
        bins = max(int(bins), 16)
        buf = self.buffer
        xs, ys = buf.column(self.x), buf.column(self.y)
        n = len(xs)
        if buf.cleared != self._cleared:
            self._reset()
        if n <= 2 * bins:  # short enough: every point, exactly
            self.size = 0
            return xs, ys
        size = 1 << int(np.ceil(np.log2(n / bins)))
        if size != self.size:
            self._reset()
            self.size = size
        end = buf.appended  # absolute row number after the newest row
        start = end - n  # absolute row number of the oldest row still held
        first_full = -(-start // size)  # first bin that starts at or after the oldest row
        last_full = end // size  # bins before this one are complete
        # Forget bins the ring has dropped rows of; keep the rest.
        if self._done and first_full > self._first_bin:
            drop = min(first_full - self._first_bin, self._done)
            self._bx, self._bmin, self._bmax = self._bx[drop:], self._bmin[drop:], self._bmax[drop:]
            self._first_bin += drop
            self._done -= drop
        if not self._done:
            self._first_bin = first_full
        todo_from = self._first_bin + self._done
        if last_full > todo_from:
            lo, hi = todo_from * size - start, last_full * size - start
            bx, bmin, bmax = _peaks(xs[lo:hi], ys[lo:hi], size)
            self._bx = np.concatenate((self._bx, bx))
            self._bmin = np.concatenate((self._bmin, bmin))
            self._bmax = np.concatenate((self._bmax, bmax))
            self._done += len(bx)
        parts = []
        head = first_full * size - start  # rows before the first full bin (its start was dropped)
        if head > 0:
            parts.append(_partial(xs[:head], ys[:head]))
        parts.append((self._bx, self._bmin, self._bmax))
        tail = last_full * size - start  # rows after the last full bin (still filling)
        if tail < n:
            parts.append(_partial(xs[tail:], ys[tail:]))
        bx = np.concatenate([p[0] for p in parts])
        out_x = np.repeat(bx, 2)
        out_y = np.empty_like(out_x)
        out_y[0::2] = np.concatenate([p[1] for p in parts])
        out_y[1::2] = np.concatenate([p[2] for p in parts])
        return out_x, out_y
