"""What a request asks its output to match: one StructuredOutputs per request.

Exactly one kind per request: a JSON schema (a dict, a pydantic model class or a JSON string),
any JSON value (`json_object=True`), a regular expression, an EBNF/GBNF grammar (xgrammar's
dialect, root rule `root`), or a list of choices (the output is one of the strings, verbatim).
Construction checks the Python types only; `grammar()` parses the constraint with xgrammar in
the caller's thread (milliseconds), so a bad schema, regex or grammar raises ValueError naming its
field before anything is queued. Compiling against the tokenizer (the slow part) is the
GrammarService's job, off the step loop.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

KINDS = ("json", "json_object", "regex", "grammar", "choice")


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # the optional extra
        raise ValueError(
            "structured: structured output needs xgrammar (pip install 'hf_paged[structured]')"
        ) from exc
    return xgrammar


@dataclass(slots=True, frozen=True)
class StructuredOutputs:
    json: object = None  # a JSON schema: dict, pydantic model class, or JSON text
    json_object: bool = False  # any JSON value (no schema)
    regex: str | None = None
    grammar: str | None = None  # EBNF/GBNF, xgrammar's dialect, root rule `root`
    choice: list[str] | tuple[str, ...] | None = None
    # the normalised constraint text: the GrammarService's cache key (with kind)
    spec: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured: exactly one of {', '.join(KINDS)} must be given, got "
                f"{given or 'none'}"
            )
        object.__setattr__(self, "spec", self._normalise(given[0]))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def field_name(self) -> str:
        """The request's field a bad constraint names in its error."""
        return f"structured.{self.kind}"

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.spec)

    def _normalise(self, kind: str) -> str:
        name = f"structured.{kind}"
        value = getattr(self, kind)
        if kind == "json_object":
            if value is not True:
                raise ValueError(f"{name} must be True or False, got {value!r}")
            return ""
        if kind == "json":
            return _schema_text(value, name)
        if kind == "choice":
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
                raise ValueError(f"{name} must be a non-empty list of strings, got {value!r:.80}")
            if not all(isinstance(c, str) and c for c in value):
                raise ValueError(f"{name} must hold non-empty strings, got {value!r:.80}")
            # the choices as one regex alternation: xgrammar compiles it like any regex
            return "|".join(f"(?:{re.escape(c)})" for c in value)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{name} must be a non-empty string, got {value!r:.80}")
        return value

    def grammar_object(self):
        """The constraint as an xgrammar Grammar (parsed, not yet compiled to token masks).
        Raises ValueError naming the field when the constraint does not parse."""
        xgr = import_xgrammar()
        kind = self.kind
        try:
            if kind == "json_object":
                return xgr.Grammar.builtin_json_grammar()
            if kind == "json":
                # compact JSON, no spaces: unbounded whitespace lets a model loop on blank lines,
                # and ": " needs a space token that not every vocabulary has
                return xgr.Grammar.from_json_schema(
                    self.spec, any_whitespace=False, separators=(",", ":")
                )
            if kind in ("regex", "choice"):
                return xgr.Grammar.from_regex(self.spec)
            return xgr.Grammar.from_ebnf(self.spec)
        except Exception as exc:  # xgrammar raises RuntimeError / its own errors
            raise ValueError(f"{self.field_name}: invalid {kind}: {_first_line(exc)}") from None


def _schema_text(value, name: str) -> str:
    """A JSON schema as canonical text (sorted keys): equal schemas share one compiled grammar."""
    if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a pydantic model
        value = value.model_json_schema()
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{name}: the schema is not valid JSON: {exc}") from None
    if isinstance(value, bool):  # JSON Schema's true/false schemas: not a useful constraint
        raise ValueError(f"{name}: a schema must be an object, got {value!r}")
    if not isinstance(value, dict):
        raise ValueError(
            f"{name} must be a JSON schema (dict, pydantic model class or JSON text), "
            f"got {type(value).__name__}"
        )
    _check_schema(value, name)
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: the schema is not JSON-serialisable: {exc}") from None


def _check_schema(schema: dict, name: str) -> None:
    """Against the JSON Schema meta-schema when jsonschema is installed: xgrammar ignores some
    malformed keywords (a "type" of 5) rather than refusing them."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"{name}: invalid JSON schema: {exc.message}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
