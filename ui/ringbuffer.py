"""Preallocated ring buffers of float64 columns for the live plots.

Each value is written twice, at ``i`` and ``i + capacity``, so the newest ``n`` rows are always one
contiguous slice: the redraw timer hands pyqtgraph views, never copies, and appending never
allocates. ``NaN`` stands for "not available" and draws as a gap (``connect='finite'``).
"""

from __future__ import annotations

import numpy as np


class RingBuffer:
    """A fixed number of named float columns; the oldest rows fall off when ``capacity`` is reached."""

    def __init__(self, capacity: int, columns: tuple[str, ...]) -> None:
        if capacity <= 0:
            raise ValueError(f"ring buffer capacity must be positive, got {capacity}")
        self.capacity = int(capacity)
        self.columns = tuple(columns)
        self._index = {name: i for i, name in enumerate(self.columns)}
        # Not filled: only written rows are ever read (``column``), and an untouched allocation costs no page
        # faults (np.full of the window's three buffers took 0.4-0.8 s of its start-up, and their memory).
        self._data = np.empty((len(self.columns), 2 * self.capacity), dtype=np.float64)
        self._head = 0  # next write position in [0, capacity)
        self._size = 0
        self.version = 0  # bumped on every change, so a redraw can skip unchanged buffers
        self.appended = 0  # rows appended since the last clear (absolute row number of the next row)
        self.cleared = 0  # bumped by clear(), so what was derived from the old rows can be dropped

    def __len__(self) -> int:
        return self._size

    def clear(self) -> None:
        self._head = 0
        self._size = 0
        self.appended = 0
        self.cleared += 1
        self.version += 1

    def append(self, row: dict[str, float | int | None]) -> None:
        """Append one row; missing or None columns become NaN (a gap, not a zero)."""
        self.extend([row])

    def extend(self, rows: list[dict[str, float | int | None]]) -> None:
        """Append many rows at once (one batch of samples)."""
        if not rows:
            return
        appended = len(rows)
        rows = rows[-self.capacity:]  # only the newest fit
        block = np.full((len(self.columns), len(rows)), np.nan, dtype=np.float64)
        for j, row in enumerate(rows):
            for name, value in row.items():
                i = self._index.get(name)
                if i is not None and value is not None:
                    block[i, j] = value
        self._write(block, appended)

    def extend_arrays(self, values: dict[str, np.ndarray]) -> None:
        """Append equal-length arrays column-wise (a recording or a benchmark loaded at once)."""
        lengths = {len(v) for v in values.values()}
        if len(lengths) != 1:
            raise ValueError("columns to append must have the same length")
        n = lengths.pop()
        if n == 0:
            return
        block = np.full((len(self.columns), n), np.nan, dtype=np.float64)
        for name, arr in values.items():
            block[self._index[name]] = np.asarray(arr, dtype=np.float64)
        self._write(block[:, -self.capacity:], n)

    def _write(self, block: np.ndarray, appended: int) -> None:
        """Store ``block`` (columns x rows, at most ``capacity`` rows: the newest of ``appended``)."""
        n = block.shape[1]
        positions = (self._head + np.arange(n)) % self.capacity
        self._data[:, positions] = block
        self._data[:, positions + self.capacity] = block
        self._head = int((self._head + n) % self.capacity)
        self._size = min(self.capacity, self._size + n)
        self.appended += appended
        self.version += 1

    def column(self, name: str) -> np.ndarray:
        """The stored values of ``name``, oldest first, as a read-only view (no copy)."""
        start = (self._head - self._size) % self.capacity
        view = self._data[self._index[name], start:start + self._size]
        view.flags.writeable = False
        return view

    def last(self, name: str) -> float | None:
        """The newest value of ``name`` that is not NaN, or None."""
        col = self.column(name)
        end = len(col)
        while end > 0:  # look back 64 rows at a time: the newest value is almost always there
            chunk = col[max(end - 64, 0):end]
            finite = np.flatnonzero(~np.isnan(chunk))
            if finite.size:
                return float(chunk[finite[-1]])
            end -= len(chunk)
        return None
