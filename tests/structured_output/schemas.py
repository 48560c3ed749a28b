"""A corpus of JSON schemas for structured-output tests: (name, schema), each bounded so that a small model's
output completes (strings with maxLength / enum / pattern, arrays with maxItems, numbers with bounds)."""

from __future__ import annotations

from typing import Any


def s(max_length: int = 12, **kw: Any) -> dict[str, Any]:
    """A bounded string."""
    return {"type": "string", "minLength": kw.pop("min_length", 1), "maxLength": max_length, **kw}


def i(lo: int = 0, hi: int = 100) -> dict[str, Any]:
    """A bounded integer."""
    return {"type": "integer", "minimum": lo, "maximum": hi}


def obj(props: dict[str, Any], required: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    """An object without additional properties; every property required unless `required` is given."""
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


def arr(items: dict[str, Any], lo: int = 1, hi: int = 3) -> dict[str, Any]:
    """A bounded array."""
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


COLORS = {"type": "string", "enum": ["red", "green", "blue"]}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("person", obj({"name": s(20), "age": i(0, 120)})),
    ("book", obj({"title": s(30), "author": s(20), "year": i(1800, 2030)})),
    ("point", obj({"x": i(-100, 100), "y": i(-100, 100)})),
    ("flag", obj({"enabled": {"type": "boolean"}})),
    ("color", obj({"color": COLORS})),
    ("rgb", obj({"r": i(0, 255), "g": i(0, 255), "b": i(0, 255)})),
    ("tags", obj({"tags": arr(s(10), 1, 3)})),
    ("scores", obj({"scores": arr(i(0, 10), 2, 4)})),
    ("city", obj({"city": s(20), "country": s(20), "population": i(0, 40000000)})),
    ("status", obj({"status": {"enum": ["active", "inactive", "pending"]}})),
    ("const", obj({"version": {"const": 1}, "kind": {"const": "event"}})),
    ("nested_address", obj({"name": s(20), "address": obj({"street": s(25), "zip": s(5, pattern="^[0-9]{5}$")})})),
    ("nested_deep", obj({"a": obj({"b": obj({"c": i(0, 9)})})})),
    ("array_of_objects", obj({"items": arr(obj({"id": i(1, 99), "label": s(10)}), 1, 2)})),
    ("matrix", obj({"rows": arr(arr(i(0, 9), 2, 2), 2, 2)})),
    ("optional_fields", obj({"name": s(15), "nickname": s(10), "age": i(0, 99)}, required=["name"])),
    ("all_optional", obj({"a": i(0, 5), "b": {"type": "boolean"}}, required=[])),
    ("number_bounds", obj({"temperature": {"type": "number", "minimum": -50, "maximum": 60}})),
    ("exclusive_bounds", obj({"ratio": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}})),
    ("price", obj({"item": s(15), "price": {"type": "number", "minimum": 0, "maximum": 1000}})),
    ("pattern_code", obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}})),
    ("pattern_phone", obj({"phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}})),
    ("hex_color", obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("date_format", obj({"event": s(20), "date": {"type": "string", "format": "date"}})),
    ("email_pattern", obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}})),
    ("uuid_format", obj({"id": {"type": "string", "format": "uuid"}})),
    ("time_pattern", obj({"at": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"}})),
    ("ipv4_format", obj({"ip": {"type": "string", "format": "ipv4"}})),
    ("anyof_scalar", obj({"value": {"anyOf": [i(0, 100), {"type": "boolean"}]}})),
    ("anyof_objects", obj({"shape": {"anyOf": [obj({"kind": {"const": "circle"}, "r": i(1, 10)}),
                                              obj({"kind": {"const": "square"}, "side": i(1, 10)})]}})),
    ("oneof_enum", obj({"unit": {"oneOf": [{"const": "kg"}, {"const": "lb"}]}})),
    ("nullable", obj({"note": {"anyOf": [s(10), {"type": "null"}]}})),
    ("type_list", obj({"count": {"type": ["integer", "null"], "minimum": 0, "maximum": 50}})),
    ("ref_defs", {"$defs": {"pt": obj({"x": i(0, 9), "y": i(0, 9)})},
                  **obj({"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}})}),
    ("ref_array", {"$defs": {"tag": s(8)}, **obj({"tags": arr({"$ref": "#/$defs/tag"}, 1, 3)})}),
    ("ref_enum", {"$defs": {"level": {"enum": ["low", "mid", "high"]}}, **obj({"level": {"$ref": "#/$defs/level"}})}),
    ("definitions_legacy", {"definitions": {"n": i(0, 9)}, **obj({"n": {"$ref": "#/definitions/n"}})}),
    ("bool_array", obj({"flags": arr({"type": "boolean"}, 1, 4)})),
    ("enum_array", obj({"colors": arr(COLORS, 1, 3)})),
    ("mixed_enum", obj({"v": {"enum": ["a", 1, True, None]}})),
    ("empty_array_allowed", obj({"list": arr(i(0, 3), 0, 2)})),
    ("recipe", obj({"name": s(20), "servings": i(1, 12), "ingredients": arr(s(15), 1, 3),
                    "vegetarian": {"type": "boolean"}})),
    ("user_profile", obj({"username": s(12, pattern="^[a-z][a-z0-9_]{2,11}$"), "role": {"enum": ["admin", "user"]},
                          "active": {"type": "boolean"}})),
    ("order", obj({"order_id": i(1000, 9999), "lines": arr(obj({"sku": s(8), "qty": i(1, 9)}), 1, 2),
                   "paid": {"type": "boolean"}})),
    ("weather", obj({"city": s(15), "forecast": arr(obj({"day": {"enum": ["mon", "tue", "wed"]},
                                                         "high": i(-20, 45)}), 1, 3)})),
    ("movie", obj({"title": s(25), "genres": arr({"enum": ["drama", "comedy", "action"]}, 1, 2),
                   "rating": i(1, 10)})),
    ("coordinates", obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                         "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
    ("semver", obj({"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]{1,2}\\.[0-9]{1,2}$"}})),
    ("tree", {"$defs": {"leaf": obj({"v": i(0, 9)}),
                        "node": obj({"v": i(0, 9), "kids": arr({"$ref": "#/$defs/leaf"}, 0, 2)})},
              "$ref": "#/$defs/node"}),
    ("top_level_array", arr(obj({"k": s(6)}), 1, 2)),
    ("top_level_enum", {"enum": ["yes", "no"]}),
    ("top_level_integer", i(1, 9)),
    ("min_length", obj({"word": s(8, min_length=3)})),
    ("key_with_spaces", obj({"first name": s(10), "last-name": s(10)})),
    ("unicode_enum", obj({"greeting": {"enum": ["héllo", "こんにちは", "hi"]}})),
]

# A few schemas that use keywords xgrammar does not enforce: `auto` sends them to llguidance.
GUIDANCE_ONLY: list[tuple[str, dict[str, Any]]] = [
    ("multiple_of", obj({"n": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5}})),
    ("multiple_of_top", {"type": "integer", "minimum": 0, "maximum": 50, "multipleOf": 7}),
]
