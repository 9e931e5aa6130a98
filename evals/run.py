"""Entry point: `python evals/run.py {accuracy,throughput,quant-accuracy,structured,...} ...`
(see cli.py).

evals/ is loaded as the package `hf_paged_evals` rather than put on sys.path: Python puts a
script's folder first on sys.path, where a module named like an installed package (PyPI's
`kernels`, which transformers probes for at import) would shadow it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = "hf_paged_evals"


def load_package():
    """Import evals/ as `hf_paged_evals` (idempotent); tests call this too."""
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    spec = importlib.util.spec_from_file_location(
        PACKAGE, HERE / "__init__.py", submodule_search_locations=[str(HERE)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    load_package()
    from hf_paged_evals.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
        sys.path.pop(0)  # see the module docstring
    sys.exit(main())
