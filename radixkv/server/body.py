"""A request body read under a size limit: the server's and the router's door for hostile uploads.

A body over the limit is a 413, answered from its Content-Length before any of it is read, or as
soon as a chunked upload passes the limit, so no client can make the process hold more than the
limit for it. A client that leaves mid-upload is one INFO line and a 499.
"""

from __future__ import annotations

import logging

from starlette.requests import ClientDisconnect, Request

from radixkv.server.errors import APIError
from radixkv.server.request_ids import request_id

log = logging.getLogger("radixkv.server")
DEFAULT_MAX_REQUEST_BYTES = 8 << 20


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to pass `limit` bytes: from its Content-Length
    before reading any of it, else while it streams in. A client gone mid-upload is logged once."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
    except ClientDisconnect:
        log.info("request %s: the client disconnected during the upload", request_id(request.scope))
        raise APIError(499, "the client disconnected") from None
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> APIError:
    """A 413 that also closes the connection: the server reads no more of the body, where
    keeping the connection would mean receiving (and discarding) the rest of it first."""
    message = f"the body has {size} bytes or more; this server takes at most {limit}"
    return APIError(
        413, message, type="invalid_request_error", code="too_large", headers={"Connection": "close"}
    )
