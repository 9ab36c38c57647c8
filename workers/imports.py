"""One lock for the first imports of huggingface_hub and transformers on the window's background threads.

transformers' lazy package is not safe to initialise from two threads at once (a second thread sees a
half-initialised module: "cannot import name 'AutoConfig'"): the calculator's warm-up (``kvscope.workers.spec_loader``)
and the installed-model scan (``kvscope.workers.installed_models``, huggingface_hub, which transformers imports too) each
hold it while they import.
"""

from __future__ import annotations

import threading

#: One pool thread at a time imports huggingface_hub / transformers: the calculator's warm-up (transformers)
#: and the installed-model scan (huggingface_hub, which transformers imports too) must not initialise the
#: same packages from two threads at once.
IMPORT_LOCK = threading.Lock()
