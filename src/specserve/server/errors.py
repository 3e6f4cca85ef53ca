"""OpenAI-style error bodies and the exception handlers that produce them.

Every failure reaches the client as {"error": {"message", "type", "param", "code"}}; bad
input is always a 4xx naming the field, never a 5xx.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.core.errors import InvalidRequestError

logger = logging.getLogger("specserve.server")

_HTTP_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}


class APIError(Exception):
    """An error the API returns on purpose, with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        if type is None:  # (OpenAI's: an unknown model is an invalid request, code and all)
            type = "rate_limit_error" if status == 429 else None
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param)


def too_long(message: str, param: str | None) -> APIError:
    """A 400 for a request past what one request can hold (the model's context or the KV
    cache): OpenAI's code, which clients branch on to trim a conversation's history."""
    return APIError(400, message, param=param, code="context_length_exceeded")


def from_invalid_request(e: InvalidRequestError, rename: dict[str, str] | None = None) -> APIError:
    """An engine validation error as a 400; `rename` maps engine field names to API ones."""
    param = (rename or {}).get(e.field, e.field)
    return APIError(400, str(e), param=param)


def _is_type_tag(part) -> bool:
    """Union members appear in pydantic error locations as tags ("str", "list[int]",
    "constrained-str", "TextPart"); they are not fields."""
    return isinstance(part, str) and (
        "[" in part or "-" in part or part[:1].isupper() or part in _TYPE_TAGS
    )


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc: tuple) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for p in loc:
        if p == "body" or _is_type_tag(p):
            continue
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body", None)
    if any(e.get("type") == "json_invalid" for e in errors):
        return bad_request("the body is not valid JSON", None)
    # The most specific location wins (for a union: the member the value came closest to).
    params = [_field_path(tuple(e.get("loc", ()))) for e in errors]
    # Among equals, a broken constraint says more than a type mismatch of another member.
    best = max(
        range(len(errors)),
        key=lambda i: (len(params[i] or ""), not str(errors[i].get("type", "")).endswith("_type")),
    )
    param, first = params[best], errors[best]
    if param is None:
        return bad_request("the body must be a JSON object", None)
    top = param.split(".")[0].split("[")[0]
    others = {p.split(".")[0].split("[")[0] for p in params if p} - {top}
    extra = f" (also invalid: {', '.join(sorted(others))})" if others else ""
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return bad_request(f"{param}: {msg}{extra}", param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError):
        return from_invalid_request(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        message = str(exc.detail)
        if message == "There was an error parsing the body":  # (FastAPI's: not UTF-8, too
            message = "the body is not valid JSON"  # deeply nested, a number too long)
        err = APIError(status, message, type=_HTTP_TYPES.get(status))
        err.headers = getattr(exc, "headers", None)
        return err.response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}").response()
