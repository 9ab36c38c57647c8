"""Export a recording's Samples as CSV, streaming: one row per Sample, never the whole file in memory.

Columns are the Sample fields in declaration order (``token, phase, time_s, text, ...``); bytes
stay integers in bytes; None ("not available") is an empty cell, never 0.

Recordings are untrusted and CSV files get opened in spreadsheets, which execute cells that start
with ``=``, ``+``, ``-``, ``@`` (CSV/formula injection: a token text ``=HYPERLINK(...)`` would become
a live formula). Text cells starting with one of those, or with a tab or carriage return, are
prefixed with a single quote, as OWASP recommends; numbers are written as numbers, so ``-1`` stays
``-1``. Pass ``escape_formulas=False`` to write text verbatim.

A CSV written to standard output (``export --csv -``) reaches a terminal, raw or through ``less``: there every
text cell is also passed through ``kvscope.core.base.safe_text.safe_text``, so a recording's ESC sequences,
carriage returns, line breaks and bidirectional overrides show as escapes (``\\x1b``, ``\\r``, ``\\n``,
``\\u202e``), one row per line, still CSV. A file keeps the text as it was (the csv module quotes it).
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import os
from collections.abc import Iterable

from kvscope.core.base.safe_text import safe_text
from kvscope.core.base.sample import Sample
from kvscope.core.records.outputs import Output, OutputError, check_output_path, open_output
from kvscope.core.records.recording import RecordingError, RecordingReader

log = logging.getLogger(__name__)

#: CSV column names: the Sample fields, in order.
CSV_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Sample))
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _cell(value: object, escape_formulas: bool, escape_controls: bool = False) -> object:
    if value is None:
        return ""
    if isinstance(value, str):
        if escape_formulas and value.startswith(_FORMULA_START):
            value = "'" + value
        return safe_text(value) if escape_controls else value
    return value  # ints and floats: csv writes repr(), which reads back to the same number


def write_csv(samples: Iterable[Sample], csv_path: str | os.PathLike[str] | Output, *,
              escape_formulas: bool = True, escape_controls: bool | None = None) -> int:
    """Write ``samples`` to ``csv_path`` (header row of field names, one row per Sample); return the rows.

    ``csv_path`` is an :class:`kvscope.core.records.outputs.Output` already checked by the caller (the command line
    checks before reading anything, with its ``--force``), or a path, checked here as the window's
    file dialog leaves it (it asked before replacing): ``-`` is standard output, and a folder, a
    device, a missing folder or a read-only file is refused (see ``kvscope.core.records.outputs``). The CSV is
    written to a temporary sibling and renamed into place when complete, so a failure half-way
    never leaves a half-written file under the requested name. ``escape_controls``: text cells as
    ``safe_text`` shows them (default: on standard output only, see the module docstring). Raises
    RecordingError when the file cannot be written (and whatever the ``samples`` iterable raises).
    """
    rows = 0
    try:
        out = check_output_path(csv_path, force=True)
    except OutputError as exc:
        raise RecordingError(f"cannot write CSV: {exc}") from None
    controls = out.stdout if escape_controls is None else escape_controls
    try:
        # newline="" as the csv module requires; utf-8 so token texts in any script survive.
        with open_output(out, newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(CSV_FIELDS)
            for sample in samples:
                writer.writerow([_cell(getattr(sample, name), escape_formulas, controls) for name in CSV_FIELDS])
                rows += 1
    except OutputError as exc:
        raise RecordingError(str(exc)) from None
    return rows


def export_csv(recording_path: str | os.PathLike[str], csv_path: str | os.PathLike[str], *,
               strict: bool = False, escape_formulas: bool = True) -> int:
    """Export the recording at ``recording_path`` to CSV at ``csv_path``; return the rows written.

    Streams (bounded memory for any size). The CSV is never written over the recording itself
    (another spelling or a link to it included): that raises RecordingError. Damaged lines are
    skipped and a truncated tail is dropped, as RecordingReader does; what was skipped is logged as
    a warning. To show it to the
    user, read with your own ``RecordingReader`` and call ``write_csv(reader, ...)`` then
    ``reader.problem()``. Raises RecordingError for a file that is not a readable recording
    (and, with ``strict=True``, for the first damaged line; no CSV is left behind then).
    """
    try:
        # Checked before reading: the recording itself is never the output.
        out = check_output_path(csv_path, inputs=(recording_path,), force=True)
    except OutputError as exc:
        raise RecordingError(f"cannot write CSV: {exc}") from None
    with RecordingReader(recording_path, strict=strict) as reader:
        rows = write_csv(reader, out, escape_formulas=escape_formulas)
        problem = reader.problem()
    if problem:
        log.warning("%s", problem)
    return rows
