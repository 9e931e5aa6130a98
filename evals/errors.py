"""The one exception the CLI turns into a single `error: ...` line (exit code 2)."""

from __future__ import annotations


class EvalError(Exception):
    """A missing or malformed input: unknown dataset or model, bad path, failed fetch/convert."""
