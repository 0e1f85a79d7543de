"""The bodies of the API's POSTs, parsed by hand after auth (FastAPI's own body handling
would answer 422 before 401): `{"reason"}` for every action, plus `profile` and
`confirm_within` for an apply. An empty body is `{}`; errors are 422 with the field's
location; nesting is bounded before json.loads sees the text."""
from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuguard.control.access import NAME_RE

MAX_BODY_DEPTH = 16  # the bodies are flat objects; deep nesting is only an attack


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReasonBody(_Body):
    reason: str | None = Field(None, max_length=500, description="why; goes to the audit log")


class ApplyBody(ReasonBody):
    profile: str = Field(pattern=NAME_RE.pattern, description="a configured profile name")
    confirm_within: float | None = Field(
        None, ge=1, le=3600, description="revert unless POST .../confirm arrives within this many seconds"
    )


def body_doc(model: type[BaseModel], required: bool) -> dict[str, Any]:
    """The OpenAPI requestBody of a route that parses its body itself."""
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def json_depth(raw: bytes, limit: int) -> int:
    """Deepest [/{ nesting of a JSON text (strings skipped), counted before parsing so a
    deep body never reaches the recursive parser (it answered 500). Stops
    counting past `limit`."""
    depth = deepest = 0
    in_str = esc = False
    for b in raw:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:  # backslash
                esc = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif b in (0x5D, 0x7D):
            depth -= 1
    return deepest


async def parse_body(request: Request, model: type[_Body]) -> _Body:
    """Size is bounded by the body limit (sinks/body_limit.py, 413) before this runs;
    depth here (422), before json.loads."""
    raw = await request.body()
    data: Any = {}
    if raw.strip():
        if json_depth(raw, MAX_BODY_DEPTH) > MAX_BODY_DEPTH:
            raise HTTPException(422, detail=[{"loc": ["body"], "msg": f"nested deeper than {MAX_BODY_DEPTH} levels",
                                              "type": "json_too_deep"}])
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise HTTPException(422, detail=[{"loc": ["body"], "msg": f"not valid JSON: {e}", "type": "json_invalid"}])
    if not isinstance(data, dict):
        raise HTTPException(422, detail=[{"loc": ["body"], "msg": "must be a JSON object", "type": "model_type"}])
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise unprocessable(e, "body") from None


def unprocessable(e: ValidationError, where: str) -> HTTPException:
    """FastAPI's 422 for what pydantic refused in the request's `where` ("body", "query"):
    `{"detail": [{"loc": [where, *field], "msg", "type"}]}`."""
    return HTTPException(422, detail=[
        {"loc": [where, *err["loc"]], "msg": err["msg"], "type": err["type"]}
        for err in e.errors(include_url=False, include_input=False, include_context=False)
    ])
