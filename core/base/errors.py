"""One error hierarchy: every error written for the user derives from ``KVScopeError`` and says its category.

The command line (``main.py``), the engine process (``kvscope.core.live.engine_process``) and the window decide how to
show a failure by its type, never by its class name:

- ``bad_input``: the user's input is wrong (a flag, a file, a config, a recording); one line, exit 2.
- ``refused``: the input is well formed but this model or runtime will not do it (gqa:3 on 8 heads, a memory
  budget reached, a switch llama.cpp cannot make); one line, exit 2.
- ``unavailable``: something the run needs is not there or died (a package, a GPU, a model that will not
  load, a runtime that aborted); one line, exit 2.
- ``internal``: a bug of ours; the traceback is shown (on stderr, in both the CLI and the window's log),
  exit 1. Any exception that is not a ``KVScopeError`` is internal too.

The existing classes keep their names and their standard bases (``SpecError`` is still a ``ValueError``),
so ``except SpecError`` and ``except ValueError`` sites keep working; they now also share this base.
"""

from __future__ import annotations

BAD_INPUT = "bad_input"
REFUSED = "refused"
UNAVAILABLE = "unavailable"
INTERNAL = "internal"
CATEGORIES = (BAD_INPUT, REFUSED, UNAVAILABLE, INTERNAL)


class KVScopeError(Exception):
    """An error of KV Scope; ``category`` (a class attribute, one of ``CATEGORIES``) says how it is shown."""

    category: str = INTERNAL


def category_of(exc: BaseException) -> str:
    """The category of any exception: a ``KVScopeError``'s own, else ``internal``."""
    category = getattr(exc, "category", INTERNAL) if isinstance(exc, KVScopeError) else INTERNAL
    return category if category in CATEGORIES else INTERNAL


def is_user_error(exc: BaseException) -> bool:
    """True when the message is written for the user (one line, no traceback, no class name)."""
    return category_of(exc) != INTERNAL


def one_line(exc: BaseException) -> str:
    """The one line that says ``exc``: its first line for a user error, ``Type: first line`` otherwise."""
    text = str(exc).strip()
    message = text.splitlines()[0] if text else type(exc).__name__
    return message if is_user_error(exc) else f"{type(exc).__name__}: {message}"


class GenerationError(KVScopeError, RuntimeError):
    """The run cannot go on (cache full, out of memory, an empty prompt...). The message is for the user.
    (Here, not in ``kvscope.core.runtimes.transformers.engine``, so that the run loop and every runtime raise it without importing torch.)"""

    category = REFUSED


class RuntimeCrashed(KVScopeError, RuntimeError):
    """A runtime's own process ended under a run (llama.cpp aborting with SIGABRT on a GGUF it refuses):
    said in one line with the signal, recorded as an ``error`` event; the app stays up."""

    category = UNAVAILABLE
