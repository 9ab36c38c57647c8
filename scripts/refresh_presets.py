"""Store in every preset what transformers makes of it (``_kvscope.view``: layer types, window,
exact parameter count, buffers, K/V bias, sdpa support), so that ``calc`` and the window read a
preset without importing torch or transformers.

Run after changing a preset or the transformers pin: ``.venv/bin/python scripts/refresh_presets.py``.
``tests/test_spec_views.py`` fails while a preset's stored view differs from a fresh one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvscope.core.model.hf import compute_view  # noqa: E402
from kvscope.core.model.hf_config import config_key  # noqa: E402
from kvscope.core.model.spec import PRESETS_DIR, _text_config  # noqa: E402


def fresh_view(cfg: dict) -> dict:
    """The view of a preset's config as transformers sees it now (what spec_from_config asks about)."""
    return compute_view(config_key(_text_config(cfg))).to_json()


def render(cfg: dict) -> str:
    """One top-level key per line, values compact: the presets' own layout."""
    items = [f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in cfg.items()]
    return "{\n" + ",\n".join(items) + "\n}\n"


def main() -> int:
    for path in sorted(PRESETS_DIR.glob("*.json")):
        cfg = json.loads(path.read_text(encoding="utf-8"))
        meta = dict(cfg.get("_kvscope") or {})
        meta["view"] = fresh_view(cfg)
        cfg = {"_kvscope": meta, **{k: v for k, v in cfg.items() if k != "_kvscope"}}
        path.write_text(render(cfg), encoding="utf-8")
        print(f"{path.name}: {meta['view']['facts']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
