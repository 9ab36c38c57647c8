"""A runtime with options of its own, written in the tests: the proof that a runtime brings everything a user touches
through the registry, and that adding one touches its own module and one registry line, nothing else.

It is the tiny runtime's fake chunked cache (``tests.tiny_runtime``) under another name, with what that one lacks:
options (``PagedOptions``, a frozen dataclass: the page size a run starts with), a flag (``--page-tokens N`` on
``run`` and ``calc``, with its range), a ``calc`` answer, a Source list entry ("Paged cache (tests)") and how the
window's form becomes its request (the Cache combo's ``chunk:N``, else Max context's page). ``register_paged()`` is
its one registry line; nothing in main.py, ui/, workers/ or core/ names it (``tests/test_runtime_options.py`` checks).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

from kvscope.core import runtimes
from kvscope.core.base.sample import Sample
from kvscope.core.model.attention import SettingsError
from kvscope.core.model.request import ModelInfo, RunForm, RunRequest
from tests import tiny_runtime

NAME = "tiny-paged"
ENTRY = "tiny-paged-entry"
FLAG = "--page-tokens"


@dataclass(frozen=True)
class PagedOptions:
    """How a paged run starts: ``page`` tokens per page (1 to 4096)."""

    page: int = 32


def add_flags(parser: Any, command: str) -> dict[str, tuple[float, float, str]]:
    g = parser.add_argument_group(f"--runtime {NAME} (tests)")
    g.add_argument(FLAG, type=int, default=None, metavar="N", help="tokens per page of the fake paged cache")
    return {"page_tokens": (1, 4096, "tokens per page")}


def cli_options(args: Any) -> PagedOptions:
    page = getattr(args, "page_tokens", None)
    if getattr(args, "cache", "dynamic") not in (None, "dynamic"):
        raise SettingsError(f"--runtime {NAME} pages its cache: give {FLAG} N, not --cache")
    return PagedOptions(page=page) if page is not None else PagedOptions()


def calc_text(args: Any, spec: Any, contexts: list[int], gpu_memory: int | None) -> str:
    """``calc --runtime tiny-paged``: the bytes each context reserves in whole pages."""
    options = cli_options(args)
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * tiny_runtime.ELEMENT_BYTES
    rows = [f"{n} tokens: {math.ceil(n / options.page) * options.page * per_token} B in pages of {options.page}"
            for n in contexts]
    return "\n".join(rows)


def source_entries() -> tuple[runtimes.SourceEntry, ...]:
    return (runtimes.SourceEntry(key=ENTRY, label="Paged cache (tests)", tooltip="Paged: the embedded model's "
                                 "config in a fake paged cache (a test's runtime)."),)


def form_request(form: RunForm) -> RunRequest:
    page = PagedOptions().page
    if form.cache.startswith("chunk:"):
        page = int(form.cache.split(":", 1)[1])
    elif form.max_context:
        page = max(1, min(4096, form.max_context // 64))
    return RunRequest(**form.common(), runtime=NAME, options={NAME: PagedOptions(page=page)})


class PagedRuntime(tiny_runtime.TinyRuntime):
    """The tiny runtime's chunked cache, its first chunk the options' page."""

    name = NAME

    def __init__(self, request: RunRequest, progress: Callable[[str], None]) -> None:
        super().__init__(request, progress)
        self.options: PagedOptions = runtimes.options_of(request)

    def load(self) -> None:
        super().load()
        self.cache = tiny_runtime.ChunkedCache(self.options.page, self.per_token)

    def model_info(self) -> ModelInfo:
        return dataclasses.replace(super().model_info(), runtime=NAME, label=f"{self.spec.label} ({NAME})")

    def settings(self, request: RunRequest) -> dict[str, Any]:
        return {**super().settings(request), "runtime": NAME, "page": self.options.page}

    def _sample(self, phase: str, text: str, event: str | None = None, **fields: Any) -> Sample:
        return dataclasses.replace(super()._sample(phase, text, event, **fields), runtime=NAME)


def open_paged(request: RunRequest, progress: Callable[[str], None]) -> PagedRuntime:
    return PagedRuntime(request, progress)


def register_paged() -> runtimes.RuntimeInfo:
    """The one registry line."""
    return runtimes.register(runtimes.RuntimeInfo(
        name=NAME, open=open_paged, label="a fake paged cache (tests)", parse_switch=tiny_runtime.parse_switch,
        reserves_at_load=True, options=PagedOptions, add_flags=add_flags, cli_options=cli_options, calc=calc_text,
        source_entries=source_entries, form_request=form_request))
