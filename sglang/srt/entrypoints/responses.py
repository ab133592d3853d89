"""A JSON response serialized with orjson (fast, and it handles numpy values) for every route."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import Response


class ORJSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)
