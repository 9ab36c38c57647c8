"""The models already on this machine: the Hugging Face cache, Ollama's and LM Studio's stores, and folders
the user added. No network, no Qt, nothing loaded: only folders listed and small files read.

``scan_installed`` lists them as ``InstalledModel`` values whose ``source`` is what every model entry point
takes (a model folder or a GGUF file), with one line of ``notes`` per entry it skipped; ``find_installed`` is
the list alone. Neither raises for what it finds.

Every store is untrusted input, and the scan never blocks on one:

- only regular files are opened, and only after ``os.stat`` says so; the open is non-blocking and the open
  file is checked again (``fstat``), so a FIFO, a device or a link to ``/dev/zero`` is never read;
- reads are bounded (a ref 4 KiB, a manifest 16 KiB, a params blob 64 KiB, a config.json 8 MiB, its size
  checked before it is read: ``kvscope.core.model.hf_config.read_config_json``);
- walks are bounded in depth, in entries and in time (``STORE_BUDGET_S`` per store), and stop at once when
  the caller cancels;
- one bad entry (a FIFO for ``refs/main``, a ref that is not UTF-8, a snapshot 1,500 folders deep, a manifest
  nested 100,000 deep, a name that is not UTF-8) is skipped with a note; the rest of its store is listed.

It takes milliseconds on a typical machine; the window still runs it off the GUI thread.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from kvscope.core.base.safe_text import safe_text as printable
from kvscope.core.model.hf_config import read_config_json
from kvscope.core.model.spec import SpecError, human_bytes

#: Hugging Face organisations whose repos are MLX conversions (``mlx_lm.convert`` output).
MLX_ORGS = ("mlx-community", "lmstudio-community-mlx")


def mlx_format(folder: str | Path, config: dict[str, Any] | None = None) -> str | None:
    """Why ``folder`` is an MLX model (a one-word reason), or None when it does not look like one.

    An ``mlx_lm.convert`` folder says so in its config: a ``quantization`` entry ({"group_size", "bits"}) that
    transformers' own configs never carry (theirs is ``quantization_config``); a Hugging Face cache repo of an
    MLX organisation (``models--mlx-community--...``) is one whatever its config says. Reads nothing but the
    config given (the installed-model scan has read it, bounded)."""
    path = Path(folder)
    parts = [p.lower() for p in path.parts]
    if any(p.startswith(f"models--{org}--") for p in parts for org in MLX_ORGS) or any(org in parts for org in MLX_ORGS):
        return "mlx-community"
    if any(re.search(r"(^|[-_.])mlx($|[-_.])", p) for p in parts[-2:]):  # LM Studio's "...-MLX-4bit" folders
        return "mlx-name"
    if isinstance(config, dict) and isinstance(config.get("quantization"), dict):
        return "mlx-quantized"
    return None

log = logging.getLogger(__name__)

ORIGINS = ("hf-cache", "ollama", "lm-studio", "folder")
ORIGIN_NAMES = {"hf-cache": "Hugging Face cache", "ollama": "Ollama", "lm-studio": "LM Studio", "folder": "added folder"}

OLLAMA_MODEL = "application/vnd.ollama.image.model"
OLLAMA_PARAMS = "application/vnd.ollama.image.params"
OLLAMA_REGISTRY = "registry.ollama.ai"
#: An Ollama manifest is a few hundred bytes (a kilobyte or two with many layers); anything past this is not one.
MAX_MANIFEST_BYTES = 16 << 10
#: Ollama's params blob is a small JSON object (num_ctx, stop, temperature...).
MAX_PARAMS_BYTES = 64 << 10
#: A Hugging Face ref (refs/main) is a 40-character commit hash.
MAX_REF_BYTES = 4 << 10
#: How many manifests one Ollama store may list (tags included).
MAX_MANIFESTS = 10_000
#: A folder walk goes this many levels below the folder (LM Studio's publisher/repo/file is 2).
MAX_DEPTH = 4
#: And looks at no more than this many directory entries in all.
MAX_ENTRIES = 20_000
#: And lists no more than this many models.
MAX_MODELS = 2_000
#: A Hugging Face snapshot is walked this deep (a repo's files sit a level or two down at most).
MAX_SNAPSHOT_DEPTH = 16
#: Entries looked at in one Hugging Face cache (repos, revisions and their files together).
MAX_CACHE_ENTRIES = 200_000
#: Seconds one store (the cache, Ollama's store, one LM Studio folder, one added folder) may take.
STORE_BUDGET_S = 5.0
#: Notes kept per store; the rest are counted.
MAX_NOTES = 20

_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf", re.IGNORECASE)
_SKIP_DIRS = {"node_modules", "__pycache__", "site-packages", ".git"}


@dataclass(frozen=True)
class InstalledModel:
    """One model found on disk.

    ``source``: a model folder (``kind`` "hf": it holds config.json; "mlx" for an MLX conversion, which runs with
    MLX: ``mlx_format``) or a GGUF file (``kind`` "gguf"; an
    Ollama blob has no .gguf suffix). ``origin``: one of ``ORIGINS``. ``size_bytes``: bytes on disk (a
    revision's files, a folder's files, a GGUF file or all its shards). ``num_ctx``: the context Ollama runs
    the model with, when its params set one. ``label`` has its control characters escaped (it is shown).
    """

    label: str
    source: str
    kind: str
    origin: str
    size_bytes: int
    num_ctx: int | None = None

    @property
    def origin_name(self) -> str:
        """Where it comes from, for people: "Ollama", "Hugging Face cache"..."""
        return ORIGIN_NAMES.get(self.origin, self.origin)

    def describe(self) -> str:
        """One line: ``llama3.2:1b · Ollama · 1.3 GiB`` (plus the context Ollama runs it with, if set)."""
        parts = [self.label, self.origin_name, human_bytes(self.size_bytes)]
        if self.num_ctx:
            parts.append(f"num_ctx {self.num_ctx:,}")
        return " \u00b7 ".join(parts)


@dataclass(frozen=True)
class InstalledScan:
    """What one look found: ``models`` (as ``find_installed`` returns them) and ``notes``, one line per entry
    skipped or store cut short, saying where and why (control characters escaped)."""

    models: list[InstalledModel]
    notes: list[str]


class _Skip(Exception):
    """This entry is skipped; the message says why, for the note."""


class _Stop(Exception):
    """This store is cut short (its time is up, or the caller cancelled)."""


@dataclass
class _Store:
    """One store being listed: what it found so far, its notes, and its deadline."""

    origin: str
    budget_s: float
    cancelled: Callable[[], bool]
    models: list[InstalledModel] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: int = 0
    deadline: float = 0.0

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.budget_s

    def note(self, where: str | os.PathLike, why: str) -> None:
        self.skipped += 1
        if len(self.notes) < MAX_NOTES:
            self.notes.append(f"{ORIGIN_NAMES[self.origin]}: skipped {printable(os.fspath(where))}: {printable(why)}")

    def tick(self) -> None:
        """Between two entries: end the store when its time is up or the caller cancelled."""
        if self.cancelled():
            raise _Stop("cancelled")
        if time.monotonic() > self.deadline:
            raise _Stop(f"stopped after {self.budget_s:g} s (the models found until then are listed)")


def _not_utf8(path: str) -> bool:
    """A name the OS gave with bytes that are not UTF-8: no widget can carry it back unchanged."""
    return any(0xDC80 <= ord(ch) <= 0xDCFF for ch in path)


def scan_installed(home: Path | None = None, extra_folders: Iterable[str | Path] = (),
                   hf_cache: str | Path | None = None, origins: Iterable[str] = ORIGINS, *,
                   budget_s: float | None = None, cancelled: Callable[[], bool] = lambda: False) -> InstalledScan:
    """Every model found: the Hugging Face cache, Ollama, LM Studio, then ``extra_folders``, each sorted by
    label, and a note for each entry skipped. A file or folder reached twice (an added folder that is LM
    Studio's) is listed once, first.

    ``home``: where ``~/.ollama`` and ``~/.lmstudio`` are (default: the user's home). ``hf_cache``: the
    Hugging Face hub cache (default: huggingface_hub's own ``HF_HUB_CACHE``, which follows HF_HUB_CACHE and
    HF_HOME). ``$OLLAMA_MODELS``, when set, is Ollama's store, as for Ollama itself. ``origins``: look only
    there (the window lists the stores that need no import of huggingface_hub first). ``budget_s``: seconds
    per store (default ``STORE_BUDGET_S``). ``cancelled``: asked between entries; True ends the look at once
    (with what was found). Never raises.
    """
    home = Path(home) if home is not None else Path.home()
    budget = STORE_BUDGET_S if budget_s is None else float(budget_s)
    stores: list[tuple[str, Callable[[_Store], None]]] = []
    wanted = set(origins)
    if "hf-cache" in wanted:
        stores.append(("hf-cache", lambda s: _hf_cache(hf_cache, s)))
    if "ollama" in wanted:
        stores.append(("ollama", lambda s: _ollama(_ollama_root(home), s)))
    if "lm-studio" in wanted:
        for root in (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"):
            stores.append(("lm-studio", lambda s, root=root: _walk(root, s, label_by_name=True)))
    if "folder" in wanted:
        for folder in extra_folders:
            try:
                root = Path(folder).expanduser()
            except (TypeError, ValueError, RuntimeError):  # not a path; ~user of no user
                continue
            stores.append(("folder", lambda s, root=root: _walk(root, s, label_by_name=False)))
    found: list[InstalledModel] = []
    notes: list[str] = []
    by_origin: dict[str, list[InstalledModel]] = {}
    for origin, fill in stores:
        if cancelled():
            break
        store = _Store(origin, budget, cancelled)
        try:
            fill(store)
        except _Stop as stop:
            if str(stop) != "cancelled":
                notes.append(f"{ORIGIN_NAMES[origin]}: {stop}")
        except Exception:  # a bug here must not cost the user the other stores
            log.exception("listing installed models")
            notes.append(f"{ORIGIN_NAMES[origin]}: stopped by an internal error (see the log)")
        by_origin.setdefault(origin, []).extend(store.models)
        notes.extend(store.notes)
        if store.skipped > len(store.notes):
            notes.append(f"{ORIGIN_NAMES[origin]}: and {store.skipped - len(store.notes):,} more entries skipped")
    for origin in ORIGINS:
        found.extend(sorted(by_origin.get(origin, ()), key=lambda m: (m.label.lower(), m.label, m.source)))
    for line in notes:
        log.info("installed models: %s", line)
    # An added folder may be a store listed already (or inside another added folder): its files once.
    # (Two Ollama tags of one blob stay two entries, as `ollama list` shows them.)
    seen = {_identity(m.source) for m in found if m.origin != "folder"}
    unique = []
    for model in found:
        if model.origin == "folder":
            key = _identity(model.source)
            if key in seen:
                continue
            seen.add(key)
        unique.append(model)
    return InstalledScan(unique[:MAX_MODELS], notes)


def find_installed(home: Path | None = None, extra_folders: Iterable[str | Path] = (),
                   hf_cache: str | Path | None = None, origins: Iterable[str] = ORIGINS) -> list[InstalledModel]:
    """The models of ``scan_installed`` (same arguments), without its notes. Never raises."""
    return scan_installed(home, extra_folders, hf_cache, origins).models


def _identity(source: str) -> str:
    try:
        return os.path.realpath(source)
    except (OSError, ValueError):
        return source


# ------------------------------------------------------------------------------------------------
# Reading untrusted files without blocking


_KIND_NAMES = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KIND_NAMES if test(mode)), "not a regular file")


def regular_size(path: str | os.PathLike) -> int:
    """The size in bytes of the regular file at ``path`` (a link followed). Raises ``_Skip`` for anything
    else: nothing there, a broken or looping link, a FIFO, a device, a socket, a folder."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise _Skip(exc.strerror or str(exc)) from None
    except ValueError as exc:  # a NUL in the name
        raise _Skip(str(exc)) from None
    if not stat.S_ISREG(st.st_mode):
        raise _Skip(f"{_kind(st.st_mode)}, not a regular file")
    return st.st_size


def read_small(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them. Raises ``_Skip`` when it is not
    a regular file, is larger than ``limit`` (not read), or cannot be read.

    Checked with ``os.stat`` before it is opened; opened non-blocking (a FIFO swapped in meanwhile cannot
    hold the open) and checked again on the open file, so a FIFO or a device is never read.
    """
    size = regular_size(path)
    if size > limit:
        raise _Skip(f"{size:,} bytes, more than the {limit:,} one can be")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise _Skip(exc.strerror or str(exc)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Skip(f"{_kind(st.st_mode)}, not a regular file")
        chunks, got = [], 0
        while got <= limit:
            chunk = os.read(fd, min(65536, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as exc:
        raise _Skip(exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    if got > limit:
        raise _Skip(f"more than the {limit:,} bytes one can be")
    return b"".join(chunks)


def _list_dir(folder: str | os.PathLike, store: _Store, limit: int) -> list[os.DirEntry]:
    """``folder``'s entries, sorted by name, at most ``limit`` (a note says when there were more); none when
    it cannot be read."""
    entries = []
    try:
        with os.scandir(folder) as it:
            for entry in it:
                if len(entries) >= limit:
                    store.note(folder, f"more than {limit:,} entries; the first {limit:,} looked at")
                    break
                entries.append(entry)
    except OSError:
        return []
    return sorted(entries, key=lambda e: e.name)


def _is_dir(entry: os.DirEntry, follow: bool = True) -> bool:
    try:
        return entry.is_dir(follow_symlinks=follow)
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------
# The Hugging Face cache


@dataclass
class _Revision:
    name: str
    path: Path
    files: dict[Path, int]  # file in the snapshot -> bytes of its blob
    size: int  # bytes of its distinct blobs
    last_modified: float


def _hf_cache(cache: str | Path | None, store: _Store) -> None:
    """Model repos of the hub cache: each repo's newest revision that holds a model's config.json, and the
    GGUF files of its newest revision. The cache is read here, the layout huggingface_hub's own
    (``models--org--name/{refs,snapshots,blobs}``), not with its ``scan_cache_dir``: that opens refs without
    looking (a FIFO blocks it, a link to /dev/zero reads without end) and one bad repo ends the whole scan."""
    if cache is None:
        try:
            import huggingface_hub.constants
        except ImportError:  # pragma: no cover - huggingface_hub is a dependency
            return
        cache = huggingface_hub.constants.HF_HUB_CACHE
    try:
        folder = Path(cache).expanduser().resolve()
        if not folder.is_dir():
            return
    except (OSError, RuntimeError, ValueError):
        return
    budget = [MAX_CACHE_ENTRIES]  # entries left for the whole cache (a box the repos' walks share)
    for entry in _list_dir(folder, store, MAX_CACHE_ENTRIES):
        if not entry.name.startswith("models--") or not _is_dir(entry):
            continue
        store.tick()
        try:
            _hf_repo(Path(entry.path), entry.name[len("models--"):].replace("--", "/"), store, budget)
        except _Skip as skip:
            store.note(entry.path, str(skip))
        if budget[0] <= 0:
            store.note(folder, f"more than {MAX_CACHE_ENTRIES:,} entries; the rest not looked at")
            return


def _hf_repo(repo: Path, repo_id: str, store: _Store, budget: list[int]) -> None:
    if _not_utf8(str(repo)):
        raise _Skip("its name is not UTF-8")
    main = None
    ref = repo / "refs" / "main"
    if os.path.lexists(ref):
        try:
            main = read_small(ref, MAX_REF_BYTES).decode("ascii").strip()
        except _Skip as skip:
            store.note(ref, f"{skip} (the repo is listed without it)")
        except UnicodeDecodeError:
            store.note(ref, "not a commit hash (not ASCII text; the repo is listed without it)")
    revisions = []
    for entry in _list_dir(repo / "snapshots", store, 1_000):
        if not _is_dir(entry, follow=False):
            continue
        store.tick()
        revisions.append(_hf_revision(Path(entry.path), store, budget))
        if budget[0] <= 0:
            break
    revisions.sort(key=lambda r: (r.last_modified, r.name == main, r.name), reverse=True)
    label = printable(repo_id)
    for rev in revisions:
        config = rev.path / "config.json"
        if config in rev.files and _is_model_config(config, store):
            store.models.append(InstalledModel(label, str(rev.path), _folder_kind(repo), "hf-cache", rev.size))
            break
    if revisions:
        newest = revisions[0]
        for path in _gguf_files(newest.files):
            store.models.append(InstalledModel(f"{label}/{printable(path.relative_to(newest.path).as_posix())}",
                                               str(path), "gguf", "hf-cache", _shards_size(path, newest.files)))


def _hf_revision(path: Path, store: _Store, budget: list[int]) -> _Revision:
    """A snapshot's files (links followed to regular files only), at most ``MAX_SNAPSHOT_DEPTH`` deep."""
    files: dict[Path, int] = {}
    blobs: dict[tuple[int, int], int] = {}
    newest = None
    deep = False
    stack = [(path, 0)]
    while stack and budget[0] > 0:
        folder, depth = stack.pop()
        for entry in _list_dir(folder, store, 50_000):
            budget[0] -= 1
            if budget[0] <= 0:
                break
            if _is_dir(entry, follow=False):
                if depth + 1 >= MAX_SNAPSHOT_DEPTH:
                    deep = True
                else:
                    stack.append((Path(entry.path), depth + 1))
                continue
            try:
                st = os.stat(entry.path)
            except (OSError, ValueError) as exc:
                store.note(entry.path, f"{getattr(exc, 'strerror', None) or exc} (a broken link?)")
                continue
            if not stat.S_ISREG(st.st_mode):
                store.note(entry.path, f"{_kind(st.st_mode)}, not a regular file")
                continue
            if _not_utf8(entry.path):
                store.note(entry.path, "its name is not UTF-8")
                continue
            files[Path(entry.path)] = st.st_size
            blobs[(st.st_dev, st.st_ino)] = st.st_size
            newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
        store.tick()
    if deep:
        store.note(path, f"folders more than {MAX_SNAPSHOT_DEPTH} levels deep not looked at")
    if newest is None:
        try:
            newest = os.stat(path).st_mtime
        except OSError:
            newest = 0.0
    return _Revision(path.name, path, files, sum(blobs.values()), newest)


def _folder_kind(folder: Path) -> str:
    """"mlx" for an MLX conversion (an mlx-community repo, LM Studio's "-MLX-" folders: run with MLX), else "hf"."""
    return "mlx" if mlx_format(folder) else "hf"


def _is_model_config(path: Path, store: _Store | None = None) -> bool:
    """A transformers config (names a model type or its architectures), not any JSON called config.json.
    A config.json that cannot be one (not a regular file, too large, not JSON...) gets a note."""
    try:
        cfg = read_config_json(path)  # the one reader: its size checked first, never blocks
    except SpecError as exc:
        if store is not None:
            store.note(path, str(exc).replace(str(path), "it", 1))
        return False
    return isinstance(cfg.get("model_type"), str) or isinstance(cfg.get("architectures"), list)


# ------------------------------------------------------------------------------------------------
# GGUF files (shared by every source that lists files)


def _is_gguf_name(name: str) -> bool:
    lower = name.lower()
    return lower.endswith(".gguf") and not lower.startswith("mmproj")  # projector files are not models


def _gguf_files(sizes: dict[Path, int]) -> list[Path]:
    """The GGUF models among ``sizes``' files: a split model once, by its first shard."""
    out = []
    for path in sizes:
        if not _is_gguf_name(path.name):
            continue
        shard = _SHARD.search(path.name)
        if shard and int(shard.group(1)) != 1:
            continue
        out.append(path)
    return sorted(out)


def _shards_size(path: Path, sizes: dict[Path, int]) -> int:
    """Bytes of a GGUF file, or of all the shards of a split one (those present)."""
    shard = _SHARD.search(path.name)
    if not shard:
        return sizes.get(path, 0)
    stem = path.name[:shard.start()]
    total = shard.group(2)
    return sum(size for p, size in sizes.items() if p.parent == path.parent and
               (m := _SHARD.search(p.name)) is not None and p.name[:m.start()] == stem and m.group(2) == total)


# ------------------------------------------------------------------------------------------------
# Ollama


def _ollama_root(home: Path) -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else home / ".ollama" / "models"


def _ollama(root: Path, store: _Store) -> None:
    """Ollama's tags: manifests/<registry>/<namespace>/<model>/<tag>, each naming its GGUF blob."""
    manifests = root / "manifests"
    count = 0
    for registry in _entries(manifests, store, dirs=True):
        for namespace in _entries(registry, store, dirs=True):
            for model in _entries(namespace, store, dirs=True):
                for tag in _entries(model, store, dirs=False):
                    store.tick()
                    count += 1
                    if count > MAX_MANIFESTS:
                        store.note(manifests, f"more than {MAX_MANIFESTS:,} manifests; the rest not looked at")
                        return
                    try:
                        store.models.append(_ollama_model(root, tag, registry.name, namespace.name, model.name))
                    except _Skip as skip:
                        store.note(tag, str(skip))


def _ollama_model(root: Path, manifest: Path, registry: str, namespace: str, model: str) -> InstalledModel:
    if _not_utf8(str(manifest)):
        raise _Skip("its name is not UTF-8")
    data = read_small(manifest, MAX_MANIFEST_BYTES)
    try:
        doc = json.loads(data)
    except ValueError:  # not UTF-8, not JSON, a number of more than 4,300 digits
        raise _Skip("not a manifest (not JSON)") from None
    except RecursionError:
        raise _Skip("not a manifest (JSON nested too deep)") from None
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, list):
        raise _Skip("not a manifest (no list of layers)")
    blob = params = None
    for layer in layers[:1000]:
        if not isinstance(layer, dict):
            continue
        media = layer.get("mediaType")
        if media == OLLAMA_MODEL and blob is None:
            blob = _blob(root, layer.get("digest"))  # the model layer must name a file we can trust
        elif media == OLLAMA_PARAMS and params is None:
            try:
                params = _blob(root, layer.get("digest"))
            except _Skip:
                params = None  # no params: Ollama's defaults
    if blob is None:
        raise _Skip("no model layer")
    size = regular_size(blob)
    if registry == OLLAMA_REGISTRY:
        name = model if namespace == "library" else f"{namespace}/{model}"
    else:
        name = f"{registry}/{namespace}/{model}"
    return InstalledModel(printable(f"{name}:{manifest.name}"), str(blob), "gguf", "ollama", size,
                          _num_ctx(params) if params is not None else None)


def _blob(root: Path, digest) -> Path:
    """The blob a layer's digest names: only ``sha256:`` and 64 lowercase hex digits (no path in it), a
    regular file (a link followed). Raises ``_Skip``."""
    match = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if match is None:
        raise _Skip(f"the model layer's digest {printable(repr(digest)[:80])} is not sha256 and 64 hex digits")
    path = root / "blobs" / f"sha256-{match.group(1)}"
    try:
        regular_size(path)
    except _Skip as skip:
        raise _Skip(f"its blob sha256-{match.group(1)[:12]}...: {skip}") from None
    return path


def _num_ctx(params: Path) -> int | None:
    try:
        doc = json.loads(read_small(params, MAX_PARAMS_BYTES))
    except (_Skip, ValueError, RecursionError):
        return None
    value = doc.get("num_ctx") if isinstance(doc, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    if value <= 0 or value > (1 << 40) or int(value) != value:
        return None
    return int(value)


def _entries(folder: Path, store: _Store, dirs: bool) -> list[Path]:
    """The (non-hidden) subfolders or files of ``folder``, sorted; none if it cannot be read."""
    out = []
    for entry in _list_dir(folder, store, MAX_MANIFESTS):
        if entry.name.startswith("."):
            continue
        try:
            is_dir = entry.is_dir()
        except OSError:  # a link loop: no folder; as a file, reading it says why it is skipped
            is_dir = False
        if is_dir == dirs:
            out.append(Path(entry.path))
    return out


# ------------------------------------------------------------------------------------------------
# LM Studio and the user's folders


def _walk(root: Path, store: _Store, label_by_name: bool) -> None:
    """GGUF files and model folders (holding a transformers config.json) in ``root``, at most ``MAX_DEPTH``
    levels down and ``MAX_ENTRIES`` entries in all; hidden folders, symlink loops and a model folder's own
    subfolders are not entered. Labels: the file's name (LM Studio) or the path below ``root``.
    (LM Studio keeps <publisher>/<repo>/<file>.gguf; MLX models are folders with a config.)"""
    try:
        if not root.is_dir():
            return
    except (OSError, ValueError):
        return
    budget = MAX_ENTRIES
    seen: set[tuple[int, int]] = set()
    stack: list[tuple[Path, int]] = [(root, 0)]
    too_deep = False
    while stack:
        store.tick()
        folder, depth = stack.pop()
        try:
            st = folder.stat()
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            with os.scandir(folder) as it:
                entries = []
                for entry in it:
                    budget -= 1
                    if budget < 0:
                        break
                    entries.append(entry)
        except OSError:
            continue
        files: dict[Path, int] = {}
        subdirs = []
        for entry in entries:
            name = entry.name
            wanted = name == "config.json" or _is_gguf_name(name)
            try:
                if entry.is_dir():
                    if not name.startswith(".") and name not in _SKIP_DIRS:
                        subdirs.append(Path(entry.path))
                    continue
                if not wanted:
                    continue
                if _not_utf8(entry.path):
                    raise _Skip("its name is not UTF-8")
                files[Path(entry.path)] = regular_size(entry.path)
            except OSError as exc:  # a link loop, a name too long
                if wanted:
                    store.note(entry.path, exc.strerror or str(exc))
            except _Skip as skip:
                store.note(entry.path, str(skip))
        is_model = folder / "config.json" in files and _is_model_config(folder / "config.json", store)
        if is_model:
            label = folder.name if folder == root or label_by_name else folder.relative_to(root).as_posix()
            store.models.append(InstalledModel(printable(label), str(folder), _folder_kind(folder), store.origin,
                                               _folder_bytes(entries)))
        for path in _gguf_files(files):
            label = path.name if label_by_name else path.relative_to(root).as_posix()
            store.models.append(InstalledModel(printable(label), str(path), "gguf", store.origin,
                                               _shards_size(path, files)))
        if budget < 0:
            store.note(root, f"more than {MAX_ENTRIES:,} entries; the rest not looked at")
            return
        if not is_model:
            if depth < MAX_DEPTH:
                stack.extend((d, depth + 1) for d in sorted(subdirs, reverse=True))
            elif subdirs:
                too_deep = True
    if too_deep:
        store.note(root, f"folders more than {MAX_DEPTH} levels down not looked at")


def _folder_bytes(entries: list[os.DirEntry]) -> int:
    """Bytes of a model folder's regular files (links followed; anything else counts 0)."""
    total = 0
    for entry in entries:
        try:
            st = entry.stat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total
