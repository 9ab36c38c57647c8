"""A model folder's files and its safetensors headers, checked by KV Scope's own bounded reader before a library opens them.

The safetensors library and MLX's loader read a header and trust it: MLX answered a truncated file, an offset past
the end, a dtype or a shape that does not fit its bytes and a header length of 2^60 with a ``RuntimeError``
traceback; both blocked forever on a FIFO named ``model.safetensors`` (``open`` waits for a writer, in Rust or C,
where no Python signal handler runs). ``check_folder_files`` refuses anything in the folder that is not a regular
file or a folder (a FIFO, a device, a socket, a link to one), so no loader ever opens it; ``check_safetensors``
reads each weights file's header itself (non-blocking open, at most ``MAX_HEADER_BYTES``) and checks it as the
format says (safetensors' ``Metadata::validate``): a known dtype, a shape of whole numbers, offsets that start
where the last tensor ended, a byte count equal to the shape's elements times the dtype's size, and the file's
length equal to the header's end plus the data. Every refusal is one line naming the file and the tensor.
No torch, no numpy: the window's process may ask too.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from kvscope.core.base.regular_file import file_kind, read_at_most
from kvscope.core.base.safe_text import safe_text
from kvscope.core.model.spec import SpecError

__all__ = ["WeightsFileError", "check_folder_files", "check_safetensors", "DTYPE_BYTES", "MAX_HEADER_BYTES"]

#: safetensors' own limit on the JSON header (``MAX_HEADER_SIZE`` in its Rust crate, 100,000,000 bytes).
MAX_HEADER_BYTES = 100_000_000
#: Bytes per element of every dtype the safetensors format names (``Dtype`` in its crate); the sub-byte ones are
#: counted in bits there and here refused unless their bytes are whole.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_SUB_BYTE_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


class WeightsFileError(SpecError):
    """A model folder's file that will not be opened or a weights file whose header lies; one line for the user."""


def check_folder_files(folder: Path, name: str) -> None:
    """Refuse ``folder`` when an entry in it is neither a regular file nor a folder (through links): a loader that
    opens a FIFO waits for a writer forever, a device never ends. A link to nothing is left to the reader that
    needs it (it says "no such file")."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as exc:
        raise WeightsFileError(f"{name}: cannot list {folder}: {exc.strerror or exc}") from None
    for entry in entries:
        try:
            mode = os.stat(entry.path).st_mode
        except OSError:
            continue
        kind = file_kind(mode)
        if kind is not None and kind != "a folder":
            link = " (through a symbolic link)" if entry.is_symlink() else ""
            raise WeightsFileError(f"{name}: {safe_text(entry.name, limit=120)} is {kind}{link}, not a regular file; "
                                   "a model folder holds regular files only, and no loader opens this one")


def _open_regular(path: Path, name: str) -> int:
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    shown = safe_text(path.name, limit=120)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise WeightsFileError(f"{name}: cannot read {shown}: {exc.strerror or exc}") from None
    kind = file_kind(os.fstat(fd).st_mode)
    if kind is not None:  # swapped for a FIFO or a device since the folder was looked at
        os.close(fd)
        raise WeightsFileError(f"{name}: {shown} is {kind}, not a regular file")
    return fd


def _tensor_bytes(dtype: str, shape: list[int]) -> int | None:
    count = math.prod(shape)
    if dtype in DTYPE_BYTES:
        return count * DTYPE_BYTES[dtype]
    bits = _SUB_BYTE_BITS.get(dtype)
    return None if bits is None or count * bits % 8 else count * bits // 8


#: How every refusal of a file's contents ends: what the user can do about it.
CORRUPT = "it may be truncated or corrupt - download it again"


def check_safetensors(path: Path, name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The header of the safetensors file ``path`` checked against itself and the file's length; returns
    ``{tensor: (dtype, shape)}``. WeightsFileError, one line naming the file (and the tensor), otherwise."""
    try:
        return _checked_header(path, name)
    except WeightsFileError as exc:
        text = str(exc)
        if "is not a valid safetensors file" in text and not text.endswith(CORRUPT):
            raise WeightsFileError(f"{text}; {CORRUPT}") from None
        raise


def _checked_header(path: Path, name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    shown = safe_text(path.name, limit=120)
    bad = f"{name}: {shown} is not a valid safetensors file"
    fd = _open_regular(path, name)
    try:
        size = os.fstat(fd).st_size
        try:
            head = read_at_most(fd, 7)
        except OSError as exc:
            raise WeightsFileError(f"{name}: cannot read {shown}: {exc.strerror or exc}") from None
        if len(head) < 8:
            raise WeightsFileError(f"{bad}: it is {size:,} bytes, shorter than the 8-byte header length it must start "
                                   "with (truncated?); it may be truncated or corrupt - download it again")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise WeightsFileError(f"{bad}: its header claims {length:,} bytes, more than the format's "
                                   f"{MAX_HEADER_BYTES:,}; it may be truncated or corrupt - download it again")
        if 8 + length > size:
            raise WeightsFileError(f"{bad}: its header claims {length:,} bytes but the file is only {size:,} "
                                   "(truncated?); it may be truncated or corrupt - download it again")
        try:
            raw = read_at_most(fd, length - 1) if length else b""
        except OSError as exc:
            raise WeightsFileError(f"{name}: cannot read {shown}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise WeightsFileError(f"{bad}: its header is not JSON; it may be truncated or corrupt - download it again") from None
    if not isinstance(header, dict):
        raise WeightsFileError(f"{bad}: its header is not a JSON object; it may be truncated or corrupt - download it again")
    data_size = size - 8 - length
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        # safetensors reads it as a map of text to text: anything else is its JSON error (tests/test_fuzz_weights.py)
        raise WeightsFileError(f"{bad}: its __metadata__ is not a map of text to text; it may be truncated or corrupt "
                               "- download it again")
    entries = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        tensor = safe_text(key, limit=120)
        if not isinstance(entry, dict):
            raise WeightsFileError(f"{bad}: tensor {tensor} has no dtype, shape and offsets")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or (dtype not in DTYPE_BYTES and dtype not in _SUB_BYTE_BITS):
            raise WeightsFileError(f"{bad}: tensor {tensor} has dtype {safe_text(repr(dtype), limit=40)}, which the "
                                   "format does not know")
        if (not isinstance(shape, list) or len(shape) > 16
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**48 for d in shape)):
            raise WeightsFileError(f"{bad}: tensor {tensor} has shape {safe_text(repr(shape), limit=60)}; a shape "
                                   "is a list of whole numbers")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
                or offsets[0] > offsets[1]):
            raise WeightsFileError(f"{bad}: tensor {tensor} has data offsets {safe_text(repr(offsets), limit=60)}; "
                                   "they are [start, end] in bytes")
        want = _tensor_bytes(dtype, shape)
        have = offsets[1] - offsets[0]
        if want != have:
            raise WeightsFileError(f"{bad}: tensor {tensor} is {dtype} {shape}, which is "
                                   f"{'not whole bytes' if want is None else f'{want:,} bytes'}, but its offsets hold "
                                   f"{have:,} bytes - the header lies about it; it may be truncated or corrupt - download it again")
        if offsets[1] > data_size:
            raise WeightsFileError(f"{bad}: tensor {tensor} ends at byte {offsets[1]:,} of the data, past the file's "
                                   f"{data_size:,} bytes of data (truncated?); it may be truncated or corrupt - download it again")
        entries.append((offsets[0], offsets[1], key, dtype, tuple(shape)))
    entries.sort()
    end = 0
    for start, stop, key, _dtype, _shape in entries:
        if start != end:
            what = "overlaps the tensor before it" if start < end else f"leaves {start - end:,} bytes unclaimed before it"
            raise WeightsFileError(f"{bad}: tensor {safe_text(key, limit=120)} {what}; it may be truncated or corrupt - download it again")
        end = stop
    if end != data_size:
        raise WeightsFileError(f"{bad}: its tensors end at byte {end:,} of the data but the file holds {data_size:,} "
                               f"bytes of data ({'truncated?' if end > data_size else 'bytes no tensor claims'}) - "
                               "download it again")
    return {key: (dtype, shape) for _s, _e, key, dtype, shape in entries}


def check_weights(folder: Path, name: str, pattern: str = "*.safetensors") -> dict[str, tuple[str, tuple[int, ...]]]:
    """``check_folder_files`` and ``check_safetensors`` of every file of ``folder`` matching ``pattern``; every
    tensor's (dtype, shape) by name."""
    check_folder_files(folder, name)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in sorted(folder.glob(pattern)):
        tensors.update(check_safetensors(path, name))
    return tensors
