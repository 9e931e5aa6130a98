"""generate()'s structured output keywords, which transformers' generate does not have:
json_schema= (a dict, pydantic model class or JSON text), json_object=True (any JSON), regex=,
grammar= (EBNF/GBNF, xgrammar's dialect) and choice= (a list of strings). One per call; every
row of the call gets the same constraint (hf_paged.structured_output)."""

from __future__ import annotations

from hf_paged.structured_output import StructuredOutputs

# generate keyword -> StructuredOutputs field
KEYWORDS = {
    "json_schema": "json",
    "json_object": "json_object",
    "regex": "regex",
    "grammar": "grammar",
    "choice": "choice",
}


def pop_structured(kwargs: dict) -> StructuredOutputs | None:
    """Take the structured output keywords out of generate's kwargs; ValueError when more than
    one is given or the constraint is bad (naming the keyword)."""
    given = {k: kwargs.pop(k) for k in list(KEYWORDS) if kwargs.get(k) not in (None, False)}
    for k in KEYWORDS:
        kwargs.pop(k, None)
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"generate: one structured output keyword at a time, got {sorted(given)}")
    ((name, value),) = given.items()
    try:
        constraint = StructuredOutputs(**{KEYWORDS[name]: value})
        constraint.grammar_object()  # a bad constraint fails here, before anything is queued
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    return constraint
