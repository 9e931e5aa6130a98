"""The `hf-paged` command: `hf-paged serve MODEL ...` (entrypoints/serve.py; `hf-paged MODEL`
too) and `hf-paged warmup MODEL ...` (entrypoints/warmup.py)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["warmup"]:
        from hf_paged.entrypoints.warmup import main as warmup

        return warmup(argv[1:])
    from hf_paged.entrypoints.serve import main as serve

    return serve(argv)


if __name__ == "__main__":
    sys.exit(main())
