"""The models already on this machine: the Hugging Face cache, Ollama's and LM Studio's stores, and folders
the user added. No network, no Qt, nothing loaded: only folders listed and small files read.

``find_installed`` lists them as ``InstalledModel`` values whose ``source`` is what every model entry point
takes (a model folder or a GGUF file). It never raises for what it finds: an unreadable folder, a corrupt
Ollama manifest or a blob that is gone are skipped. Manifests and Ollama's params blobs are untrusted input:
their size is bounded and a digest must be 64 hex digits before it names a file. Every walk is bounded in
depth and in entries, so a home folder added by mistake costs a fraction of a second, not minutes.

It takes milliseconds on a typical machine, but the Hugging Face part imports huggingface_hub (about 0.2 s)
and stats every cached file: the window runs it off the GUI thread.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

log = logging.getLogger(__name__)

ORIGINS = ("hf-cache", "ollama", "lm-studio", "folder")
ORIGIN_NAMES = {"hf-cache": "Hugging Face cache", "ollama": "Ollama", "lm-studio": "LM Studio", "folder": "added folder"}

OLLAMA_MODEL = "application/vnd.ollama.image.model"
OLLAMA_PARAMS = "application/vnd.ollama.image.params"
OLLAMA_REGISTRY = "registry.ollama.ai"
#: An Ollama manifest is a few hundred bytes; anything past this is not one.
MAX_MANIFEST_BYTES = 1 << 20
#: Ollama's params blob is a small JSON object (num_ctx, stop, temperature...).
MAX_PARAMS_BYTES = 64 << 10
#: How many manifests one Ollama store may list (tags included).
MAX_MANIFESTS = 10_000
#: A config.json is read to tell a transformers model from any other folder with a config (bounded).
MAX_CONFIG_BYTES = 4 << 20
#: A folder walk goes this many levels below the folder (LM Studio's publisher/repo/file is 2).
MAX_DEPTH = 4
#: And looks at no more than this many directory entries in all.
MAX_ENTRIES = 20_000
#: And lists no more than this many models.
MAX_MODELS = 2_000

_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf", re.IGNORECASE)
_SKIP_DIRS = {"node_modules", "__pycache__", "site-packages", ".git"}


@dataclass(frozen=True)
class InstalledModel:
    """One model found on disk.

    ``source``: a model folder (``kind`` "hf": it holds config.json) or a GGUF file (``kind`` "gguf"; an
    Ollama blob has no .gguf suffix). ``origin``: one of ``ORIGINS``. ``size_bytes``: bytes on disk (a
    revision's files, a folder's files, a GGUF file or all its shards). ``num_ctx``: the context Ollama runs
    the model with, when its params set one.
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
        from core.spec import human_bytes

        parts = [self.label, self.origin_name, human_bytes(self.size_bytes)]
        if self.num_ctx:
            parts.append(f"num_ctx {self.num_ctx:,}")
        return " \u00b7 ".join(parts)


def find_installed(home: Path | None = None, extra_folders: Iterable[str | Path] = (),
                   hf_cache: str | Path | None = None, origins: Iterable[str] = ORIGINS) -> list[InstalledModel]:
    """Every model found: the Hugging Face cache, Ollama, LM Studio, then ``extra_folders``, each sorted by
    label. A file or folder reached twice (an added folder that is LM Studio's) is listed once, first.

    ``home``: where ``~/.ollama`` and ``~/.lmstudio`` are (default: the user's home). ``hf_cache``: the
    Hugging Face hub cache (default: huggingface_hub's own ``HF_HUB_CACHE``, which follows HF_HUB_CACHE and
    HF_HOME). ``$OLLAMA_MODELS``, when set, is Ollama's store, as for Ollama itself. ``origins``: look only
    there (the window lists the stores that need no import of huggingface_hub first). Never raises.
    """
    home = Path(home) if home is not None else Path.home()
    found: list[InstalledModel] = []
    groups = {
        "hf-cache": lambda: _hf_cache(hf_cache),
        "ollama": lambda: _ollama(_ollama_root(home)),
        "lm-studio": lambda: _lm_studio(home),
        "folder": lambda: _folders(extra_folders),
    }
    wanted = set(origins)
    for origin, group in groups.items():
        if origin not in wanted:
            continue
        try:
            found.extend(sorted(group(), key=lambda m: (m.label.lower(), m.label, m.source)))
        except Exception:  # a bug here must not cost the user the other sources
            log.exception("listing installed models")
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
    return unique[:MAX_MODELS]


def _identity(source: str) -> str:
    try:
        return os.path.realpath(source)
    except (OSError, ValueError):
        return source


# ------------------------------------------------------------------------------------------------
# The Hugging Face cache


def _hf_cache(cache: str | Path | None) -> list[InstalledModel]:
    """Model repos of the hub cache: each repo's newest revision that holds a model's config.json, and the
    GGUF files of its newest revision."""
    try:
        import huggingface_hub.constants
        from huggingface_hub import scan_cache_dir
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        return []
    folder = Path(cache if cache is not None else huggingface_hub.constants.HF_HUB_CACHE)
    if not folder.is_dir():
        return []
    try:
        info = scan_cache_dir(folder)
    except Exception as exc:  # CacheNotFound, a permission error halfway...: no cache to list
        log.info("cannot scan the Hugging Face cache %s: %s", folder, exc)
        return []
    models = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        revisions = sorted(repo.revisions, key=lambda r: (r.last_modified, "main" in r.refs, r.commit_hash),
                           reverse=True)
        for rev in revisions:
            root_files = {f.file_name for f in rev.files if f.file_path.parent == rev.snapshot_path}
            if "config.json" in root_files and _is_model_config(rev.snapshot_path / "config.json"):
                models.append(InstalledModel(repo.repo_id, str(rev.snapshot_path), "hf", "hf-cache",
                                             int(rev.size_on_disk)))
                break
        if revisions:
            newest = revisions[0]
            sizes = {f.file_path: int(f.size_on_disk) for f in newest.files}
            for path in _gguf_files(sizes):
                models.append(InstalledModel(f"{repo.repo_id}/{path.relative_to(newest.snapshot_path).as_posix()}",
                                             str(path), "gguf", "hf-cache", _shards_size(path, sizes)))
    return models


def _is_model_config(path: Path) -> bool:
    """A transformers config (names a model type or its architectures), not any JSON called config.json."""
    from core.spec import SpecError, read_config_json

    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return False
        cfg = read_config_json(path)  # the one reader: not UTF-8, not JSON, not an object, nested absurdly deep
    except (OSError, SpecError):
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


def _ollama(root: Path) -> list[InstalledModel]:
    """Ollama's tags: manifests/<registry>/<namespace>/<model>/<tag>, each naming its GGUF blob."""
    manifests = root / "manifests"
    models = []
    count = 0
    for registry in _subdirs(manifests):
        for namespace in _subdirs(registry):
            for model in _subdirs(namespace):
                for tag in _entries(model):
                    count += 1
                    if count > MAX_MANIFESTS:
                        return models
                    found = _ollama_model(root, tag, registry.name, namespace.name, model.name)
                    if found is not None:
                        models.append(found)
    return models


def _ollama_model(root: Path, manifest: Path, registry: str, namespace: str, model: str) -> InstalledModel | None:
    data = _read_small(manifest, MAX_MANIFEST_BYTES)
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        log.info("skipping a corrupt Ollama manifest %s", manifest)
        return None
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, list):
        return None
    blob = params = None
    for layer in layers:
        if not isinstance(layer, dict):
            continue
        media = layer.get("mediaType")
        if media == OLLAMA_MODEL and blob is None:
            blob = _blob(root, layer.get("digest"))
            if blob is None:
                return None  # the model layer names no file we can trust, or its blob is gone
        elif media == OLLAMA_PARAMS and params is None:
            params = _blob(root, layer.get("digest"))
    if blob is None:
        return None
    try:
        size = blob.stat().st_size
    except OSError:
        return None
    if registry == OLLAMA_REGISTRY:
        name = model if namespace == "library" else f"{namespace}/{model}"
    else:
        name = f"{registry}/{namespace}/{model}"
    return InstalledModel(f"{name}:{manifest.name}", str(blob), "gguf", "ollama", size,
                          _num_ctx(params) if params is not None else None)


def _blob(root: Path, digest) -> Path | None:
    """The blob a layer's digest names: only ``sha256:`` and 64 lowercase hex digits (no path in it)."""
    if not isinstance(digest, str):
        return None
    match = _DIGEST.fullmatch(digest)
    if match is None:
        return None
    path = root / "blobs" / f"sha256-{match.group(1)}"
    try:
        return path if path.is_file() else None
    except OSError:
        return None


def _num_ctx(params: Path) -> int | None:
    data = _read_small(params, MAX_PARAMS_BYTES)
    try:
        doc = json.loads(data) if data is not None else None
    except ValueError:
        return None
    value = doc.get("num_ctx") if isinstance(doc, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    if value <= 0 or value > (1 << 40) or int(value) != value:
        return None
    return int(value)


def _read_small(path: Path, limit: int) -> bytes | None:
    """A regular file's bytes, or None if it is larger than ``limit`` or unreadable (never blocks on a FIFO)."""
    try:
        if not path.is_file():
            return None
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return None
    return data if len(data) <= limit else None


# ------------------------------------------------------------------------------------------------
# LM Studio and the user's folders


def _lm_studio(home: Path) -> list[InstalledModel]:
    """LM Studio's models folder (<publisher>/<repo>/<file>.gguf; MLX models are folders with a config)."""
    models = []
    for root in (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"):
        models.extend(_walk(root, "lm-studio", label_by_name=True))
    return models


def _folders(folders: Iterable[str | Path]) -> list[InstalledModel]:
    models = []
    for folder in folders:
        try:
            root = Path(folder).expanduser()
        except (TypeError, ValueError, RuntimeError):  # not a path; ~user of no user
            continue
        models.extend(_walk(root, "folder", label_by_name=False))
    return models


def _walk(root: Path, origin: str, label_by_name: bool) -> Iterator[InstalledModel]:
    """GGUF files and model folders (holding a transformers config.json) in ``root``, at most ``MAX_DEPTH``
    levels down and ``MAX_ENTRIES`` entries in all; hidden folders, symlink loops and a model folder's own
    subfolders are not entered. Labels: the file's name (LM Studio) or the path below ``root``."""
    try:
        if not root.is_dir():
            return
    except OSError:
        return
    budget = MAX_ENTRIES
    seen: set[tuple[int, int]] = set()
    stack: list[tuple[Path, int]] = [(root, 0)]
    while stack:
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
            try:
                if entry.is_file():
                    files[Path(entry.path)] = entry.stat().st_size
                elif entry.is_dir() and not entry.name.startswith(".") and entry.name not in _SKIP_DIRS:
                    subdirs.append(Path(entry.path))
            except OSError:
                continue
        is_model = folder / "config.json" in files and _is_model_config(folder / "config.json")
        if is_model:
            label = folder.name if folder == root or label_by_name else folder.relative_to(root).as_posix()
            yield InstalledModel(label, str(folder), "hf", origin, sum(files.values()))
        for path in _gguf_files(files):
            label = path.name if label_by_name else path.relative_to(root).as_posix()
            yield InstalledModel(label, str(path), "gguf", origin, _shards_size(path, files))
        if budget < 0:
            return
        if not is_model and depth < MAX_DEPTH:
            stack.extend((d, depth + 1) for d in sorted(subdirs, reverse=True))


def _subdirs(folder: Path) -> list[Path]:
    return [p for p in _entries(folder, dirs=True)]


def _entries(folder: Path, dirs: bool = False) -> list[Path]:
    """The (non-hidden) subfolders or files of ``folder``, sorted; none if it cannot be read."""
    out = []
    try:
        with os.scandir(folder) as it:
            for entry in it:
                if entry.name.startswith("."):
                    continue
                try:
                    if entry.is_dir() if dirs else entry.is_file():
                        out.append(Path(entry.path))
                except OSError:
                    continue
    except OSError:
        return []
    return sorted(out)
