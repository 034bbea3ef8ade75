"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and where they come from.

Every refusal names what to fix: a body that is not JSON or has a wrong type is a 400 naming the
field (pydantic's location), and an engine `ValueError` is a 400 naming the request parameter
behind the engine field its message starts with (`engine_param`). A message is at most
`MAX_MESSAGE_CHARS` characters, whatever it quotes: the places that build one quote values
through `radixkv.excerpt`, and `APIError` cuts any longer message, so no refusal echoes a large
body back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse
from pydantic import ValidationError

MAX_MESSAGE_CHARS = 512


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.message) > MAX_MESSAGE_CHARS:
            self.message = f"{self.message[: MAX_MESSAGE_CHARS - 20]}... (message cut)"

    def __str__(self) -> str:
        return self.message

    @classmethod
    def bad_request(cls, param: str | None, message: str) -> APIError:
        return cls(400, message, param=param)

    @classmethod
    def engine_dead(cls) -> APIError:
        """The 503 of a server whose engine has stopped (its loop died, or its core's process)."""
        return cls(
            503,
            "the engine is not running; the server is going down",
            type="server_error",
            code="engine_dead",
        )

    @classmethod
    def text_too_long(cls, param: str, chars: int, max_model_len: int) -> APIError:
        """A 400 naming `param`, whose text is too long to fit the model whatever its tokens."""
        return cls.bad_request(
            param,
            f"{param} has {chars} characters: more than {max_model_len} tokens "
            f"(max_model_len) can spell, so it cannot fit",
        )

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_validation(error: ValidationError) -> APIError:
    """The first problem pydantic found, naming the top-level field (None for a body that is not
    a JSON object)."""
    first = error.errors(include_url=False)[0]
    loc = [str(part) for part in first["loc"]]
    if first["type"] == "json_invalid":
        return APIError.bad_request(None, f"the body is not valid JSON: {first['msg']}")
    if not loc:
        return APIError.bad_request(None, f"the body must be a JSON object: {first['msg']}")
    # A location may hold a key the client chose (an unknown field of a strict part): cut it.
    where = ".".join(p if len(p) <= 40 else f"{p[:40]}..." for p in loc if p.isdigit() or p.isidentifier())
    return APIError.bad_request(loc[0], f"{where}: {first['msg']}")


# Engine fields whose request parameter has another name; `None` keys are filled per request.
_ENGINE_TO_API = {"beam_width": "n", "request": "max_tokens"}


def engine_param(message: str, renames: Mapping[str, str]) -> str | None:
    """The request parameter an engine ValueError is about. The engine's messages start with the
    field's name ("max_tokens must be ...", "prompt has 9000 tokens; ..."); `renames` maps the
    engine's names to this endpoint's (`prompt` -> `messages` for chat, say)."""
    word = message.split(" ", 1)[0].strip(":,;")
    word = renames.get(word, _ENGINE_TO_API.get(word, word))
    return word if word.isidentifier() else None
