"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

`code` is always a string or null, as OpenAI's is (issue #32): a short name where the cause is one
a client may act on (`context_length_exceeded`, `queue_full`, `model_not_found`, ...), else null.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """What every error answer holds: documented in /openapi.json for each status it has."""

    error: ErrorDetail


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(status, message, param, code), status_code=status, headers=headers
    )


async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (no route, wrong method), OpenAI-shaped as every other error,
    their headers kept (a 405's `Allow`: RFC 9110 requires it). The router's too."""
    phrase = (
        HTTPStatus(exc.status_code).phrase
        if exc.status_code in HTTPStatus._value2member_map_
        else ""
    )
    return error_response(
        exc.status_code, str(exc.detail or phrase), None, headers=getattr(exc, "headers", None)
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, "Request body is not valid JSON.", None)
        got = first.get("input")
        if not loc and isinstance(got, bytes):  # FastAPI leaves a body of another type unread
            message = "The request body must be JSON, sent with Content-Type: application/json."
            return error_response(400, message, None)
        param = loc[0] if loc else None
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
        if str(first.get("type")).endswith("_type"):  # strict types: say what came instead
            message += f"; got {_json_type(got)}"
        elif isinstance(got, (int, float)) and not isinstance(got, bool):  # a bound: the value
            message += f"; got {got}"
        return error_response(400, message + ".", param)

    app.add_exception_handler(StarletteHTTPException, http_error)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def _json_type(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({json.dumps(value)})"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


async def send_error(send, status: int, message: str, code: str | None, headers=()) -> None:
    """An OpenAI-shaped error straight through ASGI `send`, for middleware that answers before
    the application runs (API keys, body limits)."""
    body = json.dumps(error_body(status, message, None, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})
