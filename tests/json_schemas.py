"""Twenty JSON schemas of the shapes clients constrain output with: nested objects, arrays,
enums, numbers with bounds, alternatives, references. Each bounds what can grow (strings, arrays),
so that even a random model's output ends within a few hundred tokens."""

from __future__ import annotations

from typing import Any

Json = dict[str, Any]

NAME: Json = {"type": "string", "maxLength": 8}
SMALL: Json = {"type": "integer", "minimum": -50, "maximum": 50}
UNIT: Json = {"type": "number", "minimum": 0, "maximum": 1}


def obj(properties: Json, required: list[str] | None = None) -> Json:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: list[Json] = [
    obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    {"type": "array", "items": SMALL, "minItems": 1, "maxItems": 4},
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"a": obj({"b": {"type": "boolean"}})}),
    {"type": "number", "minimum": -5, "maximum": 5},
    obj(
        {
            "items": {
                "type": "array",
                "items": obj({"id": SMALL, "tag": {"enum": ["x", "y"]}}),
                "maxItems": 3,
            }
        }
    ),
    {"enum": ["yes", "no", "maybe"]},
    obj({"title": NAME, "note": NAME, "count": SMALL}, required=["title"]),
    obj(
        {
            "level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "temperature": {"type": "number", "exclusiveMinimum": -40, "maximum": 60},
        }
    ),
    {"type": "array", "items": NAME, "maxItems": 3},
    obj({"outer": obj({"middle": obj({"inner": SMALL})})}),
    obj({"value": {"anyOf": [SMALL, NAME]}}),
    {"type": "boolean"},
    obj({"kind": {"const": "point"}, "x": SMALL, "y": SMALL}),
    {
        "type": "array",
        "prefixItems": [SMALL, {"enum": ["a", "b"]}],
        "items": False,
        "minItems": 2,
    },
    obj({"code": {"type": "string", "pattern": "^[a-z]{2,5}$"}}),
    obj(
        {"flags": {"type": "array", "items": {"enum": ["on", "off"]}, "maxItems": 4}, "ratio": UNIT}
    ),
    {
        "oneOf": [
            obj(
                {"type": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1, "maximum": 9}}
            ),
            obj({"type": {"const": "dog"}, "good": {"type": "boolean"}}),
        ]
    },
    {
        "$defs": {"pair": obj({"k": NAME, "v": SMALL})},
        "type": "array",
        "items": {"$ref": "#/$defs/pair"},
        "maxItems": 2,
    },
    obj(
        {
            "matrix": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "array", "items": SMALL, "maxItems": 2},
            },
            "label": {"type": ["string", "null"], "maxLength": 4},
        }
    ),
]
