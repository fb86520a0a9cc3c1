"""What the HTTP server answers before a request reaches a handler: the body-size limit (413) and one error
shape, ``{"error": {"message", "type", "code"}}``, for every error FastAPI or Starlette would otherwise answer
in their own shape (``{"detail": ...}`` or plain text)."""

import logging
import re
from typing import Dict, List, Optional

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


# How pydantic names a union's branch in an error's location ('str', 'list[int]', 'function-after[...]'): not a field.
_BRANCH = re.compile(r"^(str|int|float|bool|none|dict|list)$|\[")
# The union fields of the bodies (bodies.py), and what each takes, for a value none of its forms accepts (the
# per-branch messages say it piecemeal). "[]": an item of a list that is one of the field's forms.
_UNION_FIELDS = {
    "content": 'a string, null, or a list of text parts ({"type": "text", "text": "..."})',
    "prompt": "a string, a list of token ids, or a non-empty list of strings or token-id lists",
    "prompt[]": "a string or a list of token ids",
    "inputs": "a string or a list of token ids",
    "stop": "a string, a list of strings, or null",
    "stop_sequences": "a string, a list of strings, or null",
    "tool_choice": "'auto', 'none' or an object",
}
_JSON_KINDS = {str: "string", int: "number", float: "number", bool: "boolean", list: "array"}


def _branch_at(loc: tuple) -> Optional[int]:
    """Where the first union branch name is in ``loc``: right after a union field's name, or after an item's index in
    it (a dict's key named 'str' or 'a[0]' is a key, not a branch)."""
    for i in range(1, len(loc)):
        union = loc[i - 1] in _UNION_FIELDS or (i > 1 and isinstance(loc[i - 1], int) and loc[i - 2] in _UNION_FIELDS)
        if union and isinstance(loc[i], str) and _BRANCH.search(loc[i]):
            return i
    return None


def _fields(loc: tuple) -> tuple:
    return tuple(x for x in loc if not (isinstance(x, str) and _BRANCH.search(x)))


def validation_messages(errors: List[dict]) -> List[str]:
    """One message per field for pydantic's ``errors``: a location without union branch names, and for a union that
    took none of its forms, the errors of the form the value got furthest into (a list of parts whose part misses a
    field) or, where none got in, what the field takes."""
    return [f"{'.'.join(str(x) for x in loc) or 'body'}: {msg.removeprefix('Value error, ')}"
            for loc, msg in _resolve([(tuple(e["loc"][1:]), e) for e in errors])]  # fmt: skip


def _resolve(errors: List[tuple]) -> List[tuple]:
    """``(location, message)`` for ``(location with branch names, pydantic error)`` pairs; a union's chosen branch is
    resolved again, for the unions inside it (a prompt's list of strings or token-id lists)."""
    unions: Dict[tuple, Dict[str, list]] = {}  # location of the union -> branch -> (the rest of the location, error)
    out = []
    for loc, e in errors:
        cut = _branch_at(loc)
        if cut is None:
            out.append((loc, e["msg"]))
        else:
            unions.setdefault(loc[:cut], {}).setdefault(loc[cut], []).append((loc[cut + 1 :], e))
    for where, branches in unions.items():
        depth = {b: max(len(_fields(rest)) for rest, _ in errs) for b, errs in branches.items()}
        deepest = max(depth.values())
        chosen = [b for b, d in depth.items() if d == deepest]
        if deepest > 0 and len(chosen) == 1:
            out.extend(_resolve([(where + rest, e) for rest, e in branches[chosen[0]]]))
            continue
        field = next((x for x in reversed(where) if isinstance(x, str)), "")
        takes = _UNION_FIELDS.get(field + ("[]" if isinstance(where[-1], int) else ""))
        if takes is None:
            takes = (
                "one of its forms (" + "; ".join(sorted({e["msg"] for es in branches.values() for _, e in es})) + ")"
            )
        got = repr(next(iter(branches.values()))[0][1].get("input"))
        out.append((where, f"expected {takes}, got {got if len(got) <= 60 else got[:57] + '...'}"))
    return out


def _body_message(e: dict, content_type: Optional[str]) -> str:
    """The 400 for a body that is not a JSON object: which header was sent, or which JSON value came."""
    if e["type"] == "string_unicode":  # a JSON escape can spell a lone surrogate (\ud800), which no text holds
        return "body: holds a string that is not valid Unicode (a lone surrogate escape such as \\ud800)"
    if "json" not in (content_type or "").lower() or isinstance(e.get("input"), bytes):
        # FastAPI parses JSON only under a JSON Content-Type (curl -d sends a form's): say which was sent
        return f"body: expected a JSON object with Content-Type: application/json, got Content-Type {content_type!r}"
    if e.get("input") is None:
        return "body: expected a JSON object, got null or an empty body"
    kind = _JSON_KINDS.get(type(e["input"]), "value")
    twice = " (was the body JSON-encoded twice?)" if kind == "string" else ""
    return f"body: expected a JSON object, got a JSON {kind}{twice}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        parts, fields = [], []
        for e in exc.errors():
            if e["type"] == "json_invalid":
                parts.append(f"body: invalid JSON ({e.get('ctx', {}).get('error', e['msg'])})")
            elif tuple(e["loc"]) == ("body",):
                parts.append(_body_message(e, request.headers.get("content-type")))
            else:
                fields.append(e)
        parts.extend(validation_messages(fields))
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
