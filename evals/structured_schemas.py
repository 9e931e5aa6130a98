"""JSON schemas of varied shapes for the structured output eval: nested objects, arrays, enums,
numbers with bounds, required and optional fields, each with a prompt that asks for it."""

from __future__ import annotations

S = {"type": "string", "maxLength": 24}
INT = {"type": "integer"}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


# (name, what to ask for, schema)
SCHEMAS: list[tuple[str, str, dict]] = [
    ("person", "a person", obj({"name": S, "age": {**INT, "minimum": 0, "maximum": 120}})),
    ("book", "a book", obj({"title": S, "author": S, "year": {**INT, "minimum": 1450}})),
    ("color", "a colour", obj({"color": {"enum": ["red", "green", "blue", "yellow"]}})),
    (
        "point",
        "a 2-D point",
        obj({"x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number"}}),
    ),
    (
        "flags",
        "feature flags",
        obj({"dark_mode": {"type": "boolean"}, "beta": {"type": "boolean"}}),
    ),
    ("tags", "a list of tags", obj({"tags": {"type": "array", "items": S, "maxItems": 4}})),
    (
        "scores",
        "three scores",
        obj(
            {
                "scores": {
                    "type": "array",
                    "items": {**INT, "minimum": 0, "maximum": 100},
                    "minItems": 3,
                    "maxItems": 3,
                }
            }
        ),
    ),  # fmt: skip
    (
        "address",
        "an address",
        obj({"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    ),
    (
        "user",
        "a user with an address",
        obj({"name": S, "address": obj({"city": S, "country": S})}),
    ),
    (
        "order",
        "an order",
        obj(
            {
                "id": INT,
                "items": {
                    "type": "array",
                    "items": obj({"sku": S, "qty": {**INT, "minimum": 1, "maximum": 9}}),
                    "maxItems": 3,
                },
            }
        ),
    ),
    (
        "optional",
        "a product, the price optional",
        obj({"name": S, "price": {"type": "number", "minimum": 0}}, required=["name"]),
    ),
    (
        "weather",
        "the weather",
        obj(
            {
                "temp_c": {**INT, "minimum": -50, "maximum": 60},
                "sky": {"enum": ["sunny", "cloudy", "rain"]},
            }
        ),
    ),  # fmt: skip
    ("pet", "a pet", obj({"kind": {"enum": ["cat", "dog", "fish"]}, "name": S}, ["kind"])),
    (
        "matrix",
        "a 2x2 matrix",
        obj(
            {
                "rows": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {"type": "array", "items": INT, "minItems": 2, "maxItems": 2},
                }
            }
        ),
    ),  # fmt: skip
    (
        "event",
        "an event",
        obj(
            {
                "name": S,
                "day": {**INT, "minimum": 1, "maximum": 31},
                "month": {"enum": ["jan", "feb", "mar", "apr"]},
            }
        ),
    ),  # fmt: skip
    ("nullable", "a note", obj({"text": S, "author": {"anyOf": [S, {"type": "null"}]}})),
    ("rating", "a review", obj({"stars": {**INT, "minimum": 1, "maximum": 5}, "comment": S})),
    (
        "team",
        "a team of people",
        obj({"team": S, "members": {"type": "array", "items": obj({"name": S}), "maxItems": 3}}),
    ),
    (
        "answer",
        "a yes/no answer",
        obj(
            {
                "answer": {"type": "boolean"},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
    ),  # fmt: skip
    ("version", "a version", obj({"major": INT, "minor": INT, "label": {"const": "stable"}})),
    ("list", "a list of numbers", {"type": "array", "items": INT, "minItems": 1, "maxItems": 5}),
    (
        "deep",
        "a nested config",
        obj(
            {
                "server": obj(
                    {
                        "host": S,
                        "port": {**INT, "minimum": 1, "maximum": 65535},
                        "tls": obj({"enabled": {"type": "boolean"}}),
                    }
                )
            }
        ),
    ),  # fmt: skip
    ("planet", "a planet", obj({"name": S, "moons": {**INT, "minimum": 0}}, ["name"])),
    ("country", "a country", obj({"name": S, "capital": S, "population": {**INT, "minimum": 0}})),
]

# (name, prompt, regex)
REGEXES = [
    ("date", "Today's date (YYYY-MM-DD):", r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("phone", "A US phone number:", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("email", "An email address:", r"[a-z]{2,10}@[a-z]{2,10}\.(com|org|net)"),
    ("hex", "A hex colour code:", r"#[0-9a-f]{6}"),
]
# (name, prompt, choices)
CHOICES = [
    ("sentiment", "Is 'I love this film' positive or negative?", ["positive", "negative"]),
    ("capital", "What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"]),
    ("yesno", "Is water wet? Answer yes or no.", ["yes", "no"]),
    ("animal", "Which one is a bird?", ["eagle", "shark", "tiger"]),
]
# unconstrained prompts, greedy: must be unchanged by the constrained rows beside them
PLAIN = [
    "What is the capital of Italy?",
    "Write a haiku about the sea.",
    "Name three primary colours.",
    "How many legs does a spider have?",
]
