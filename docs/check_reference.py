"""Every public name of the documented modules appears in the built API reference.

``python docs/check_reference.py docs/_build`` after ``sphinx-build``: reads each module's ``__all__`` and looks for the
name's anchor (``id="relbias.nn.KVCache"``) in the built HTML pages; exits 1 and lists the missing names otherwise.
"""

from __future__ import annotations

import importlib
import pathlib
import sys

MODULES = (
    "relbias", "relbias.nn", "relbias.distributed", "relbias.integrations.transformers", "relbias.integrations.t5",
    "relbias.integrations.t5_attention", "relbias.integrations.longt5", "relbias.integrations.common",
    "relbias.integrations.patches", "relbias.integrations.mpnet", "relbias.integrations.alibi_decoders",
    "relbias.integrations.alibi_common", "relbias.integrations.hidden_rows", "relbias.window",
)


def missing_names(site: pathlib.Path) -> list[str]:
    """The ``module.name`` of every public name without an anchor in ``site/api/*.html``."""
    html = "".join(page.read_text(encoding="utf-8") for page in (site / "api").glob("*.html"))
    return [
        f"{module}.{name}"
        for module in MODULES
        for name in importlib.import_module(module).__all__
        if f'id="{module}.{name}"' not in html
    ]


if __name__ == "__main__":
    site = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "docs/_build")
    missing = missing_names(site)
    if missing:
        print(f"{len(missing)} public names missing from the API reference: {', '.join(missing)}")
        sys.exit(1)
    print(f"API reference: every public name of {', '.join(MODULES)} is documented")
