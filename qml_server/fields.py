"""Typed reads of JSON request fields, each failure naming the field.

Hand-written rather than pydantic: the request surface is small, and the messages
(and the ``param`` in the error) stay exactly ours.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request

from qml_server.errors import bad_request, invalid_type, missing_field

JsonObject = dict[str, Any]


async def read_json_object(request: Request) -> JsonObject:
    body = await request.body()
    try:
        # NaN/Infinity are not JSON; Python accepts them by default, so refuse here
        # rather than let a NaN temperature reach the sampler.
        value = json.loads(body, parse_constant=_reject_constant)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply", code="invalid_json") from None
    if not isinstance(value, dict):
        raise bad_request("The request body must be a JSON object", code="invalid_json")
    return value


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed in JSON")


def _is_int(value: Any) -> bool:
    # bool is a subclass of int in Python, but `"max_tokens": true` is a client bug.
    return isinstance(value, int) and not isinstance(value, bool)


def opt_int(body: JsonObject, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise invalid_type(name, "an integer", value)
    return value


def opt_float(body: JsonObject, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise invalid_type(name, "a number", value)
    return float(value)


def opt_bool(body: JsonObject, name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise invalid_type(name, "a boolean", value)
    return value


def opt_str(body: JsonObject, name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid_type(name, "a string", value)
    return value


def opt_object(body: JsonObject, name: str) -> JsonObject | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_type(name, "an object", value)
    return value


def required(body: JsonObject, name: str) -> Any:
    value = body.get(name)
    if value is None:
        raise missing_field(name)
    return value


def str_list(value: Any, name: str) -> tuple[str, ...]:
    """A string or a list of strings (the form ``stop`` takes)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise invalid_type(name, "a string or a list of strings", value)


def int_list(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list) and all(_is_int(v) for v in value):
        return tuple(value)
    raise invalid_type(name, "a list of integers", value)


def is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(_is_int(v) for v in value)
