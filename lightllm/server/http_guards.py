"""What the HTTP server answers before a request reaches a handler: the body-size limit (413) and one error
shape, ``{"error": {"message", "type", "code"}}``, for every error FastAPI or Starlette would otherwise answer
in their own shape (``{"detail": ...}`` or plain text)."""

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)


class BadRequest(Exception):
    """A 400 whose message names the field, the value and what is allowed."""


class ModelNotFound(Exception):
    """A 404 for a ``model`` this server does not serve (OpenAI's ``model_not_found``)."""


def error_response(status: int, message: str, code=None) -> JSONResponse:
    """``code``: OpenAI's error code where one is defined, else the status."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": code or status}}, status)


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets a 413 before anything parses it, from its
    Content-Length when it declares one, else as soon as the bytes received pass the limit."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send, f"{int(declared)} bytes")
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending all of it
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(scope, receive, send, f"{size} bytes received so far")
            more = message.get("more_body", False)
        replayed = False

        async def replay():  # the whole body once, then the client's own messages (its disconnect)
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, size: str) -> None:
        message = f"body: {size}, more than --max_request_body_bytes ({self.limit})"
        await error_response(413, message)(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        parts = []
        for e in exc.errors():
            if e["type"] == "json_invalid":
                parts.append(f"body: invalid JSON ({e.get('ctx', {}).get('error', e['msg'])})")
                continue
            if tuple(e["loc"]) == ("body",) and isinstance(e.get("input"), (bytes, str)):
                # FastAPI parses JSON only under a JSON Content-Type (curl -d sends a form's): say which was sent
                sent = request.headers.get("content-type")
                parts.append(f"body: expected a JSON object with Content-Type: application/json, got Content-Type "
                             f"{sent!r}")  # fmt: skip
                continue
            where = ".".join(str(x) for x in e["loc"][1:]) or "body"
            parts.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
        return error_response(400, "; ".join(parts) or "invalid request")

    @app.exception_handler(BadRequest)
    async def bad(_request, exc: BadRequest):
        return error_response(400, str(exc))

    @app.exception_handler(ModelNotFound)
    async def no_model(_request, exc: ModelNotFound):
        return error_response(404, str(exc), code="model_not_found")

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        cause = exc.__cause__  # FastAPI answers a body it could not parse with a bare 400
        if isinstance(cause, RecursionError):
            return error_response(400, "body: JSON nested too deeply")
        if isinstance(cause, UnicodeDecodeError):
            return error_response(400, f"body: expected UTF-8 JSON ({cause})")
        if cause is not None:
            return error_response(exc.status_code, f"body: could not be parsed ({type(cause).__name__}: {cause})")
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def crashed(_request, exc: Exception):  # logged by Starlette, which re-raises it after this answer
        return error_response(500, f"internal error ({type(exc).__name__}); the server log has the details")
