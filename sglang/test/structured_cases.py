"""Constraints shared by the structured-output tests and the constrained-decoding benchmark."""

from __future__ import annotations

IP_REGEX = r"((25[0-5]|2[0-4]\d|[01]?\d\d?).){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"

CHARACTER_REGEX = (
    r"""\{\n"""
    + r"""    "name": "[\w\d\s]{1,16}",\n"""
    + r"""    "house": "(Gryffindor|Slytherin|Ravenclaw|Hufflepuff)",\n"""
    + r"""    "blood status": "(Pure-blood|Half-blood|Muggle-born)",\n"""
    + r"""    "occupation": "(student|teacher|auror|ministry of magic|death eater|order of the phoenix)",\n"""
    + r"""    "wand": \{\n"""
    + r"""        "wood": "[\w\d\s]{1,16}",\n"""
    + r"""        "core": "[\w\d\s]{1,16}",\n"""
    + r"""        "length": [0-9]{1,2}\.[0-9]{0,2}\n"""
    + r"""    \},\n"""
    + r"""    "alive": "(Alive|Deceased)",\n"""
    + r"""    "patronus": "[\w\d\s]{1,16}",\n"""
    + r"""    "bogart": "[\w\d\s]{1,16}"\n"""
    + r"""\}"""
)

_NAME = {"type": "string", "minLength": 1, "maxLength": 20}

# Twenty schemas: nested objects, arrays, enums, bounded numbers, optional fields and $ref. Strings and
# arrays are bounded so that even a model that would ramble ends within the token budget.
JSON_SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Lima"]}},
     "required": ["city"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
     "required": ["temperature", "unit"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "first": _NAME, "last": _NAME}, "required": ["first", "last"]}}, "required": ["person"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 30}},
     "required": ["ok"]},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                                            "maximum": 10}, "maxItems": 4}},
     "required": ["scores"]},
    {"type": "object", "properties": {"title": _NAME, "year": {"type": "integer", "minimum": 1900,
                                                               "maximum": 2030},
                                      "genre": {"enum": ["drama", "comedy", "action", "horror"]}},
     "required": ["title", "year", "genre"]},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -100,
                                                                "maximum": 100},
                                                          "y": {"type": "integer", "minimum": -100,
                                                                "maximum": 100}},
                         "required": ["x", "y"]}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
     "required": ["start", "end"]},
    {"type": "object", "properties": {"nickname": _NAME, "email": {"type": "string", "maxLength": 30}},
     "required": ["email"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}},
     "required": ["status", "count"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"name": _NAME, "price": {"type": "number", "minimum": 0,
                                                                  "maximum": 1000}},
        "required": ["name", "price"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
     "required": ["color"]},
    {"type": "object", "properties": {"country": _NAME, "capital": _NAME,
                                      "population": {"type": "integer", "minimum": 0, "maximum": 2000000000}},
     "required": ["country", "capital"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"address": {"type": "object", "properties": {
        "street": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "geo": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                 "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                "required": ["lat", "lon"]}},
        "required": ["street", "zip", "geo"]}}, "required": ["address"]},
    {"$defs": {"step": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                                         "text": {"type": "string", "maxLength": 20}},
                        "required": ["n", "text"]}},
     "type": "object", "properties": {"steps": {"type": "array", "items": {"$ref": "#/$defs/step"},
                                                "minItems": 1, "maxItems": 2}},
     "required": ["steps"]},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 30},
                                      "vaccinated": {"type": "boolean"}, "owner": _NAME},
     "required": ["kind", "age", "vaccinated"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100},
                                                          {"type": "string", "maxLength": 10}]},
                                      "note": {"type": ["string", "null"], "maxLength": 20}},
     "required": ["value", "note"]},
]

JSON_PROMPTS = [
    "Describe a person as JSON.",
    "Answer in JSON about the weather in a big city.",
    "Give me a JSON record for a movie you like.",
    "Produce JSON describing a pet.",
    "Return JSON for a shopping list.",
]

ANSWER_EBNF = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | "maybe"'

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}

STRUCTURAL_TAG = {
    "structures": [{"begin": "<function=get_weather>", "schema": WEATHER_SCHEMA, "end": "</function>"}],
    "triggers": ["<function="],
}


def chat_prompt(question: str) -> str:
    """SmolLM2-Instruct's chat format, for the native /generate API."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
