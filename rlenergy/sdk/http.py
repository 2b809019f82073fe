"""JSON over HTTP for the SDK's clients (stdlib only), with the project's retry vocabulary.

Callers: ``rlenergy.sdk.rollout`` (FlexFloor protocol client) and ``rlenergy.sdk.engines``
(elastic expert-parallel engine adapters).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from rlenergy import errors


def post_json(url: str, body: bytes | None, timeout_s: float, method: str = "POST") -> Any | None:
    """POST a JSON body (or, ``method="GET"``, no body) and decode the JSON reply.

    Args:
        url: full URL (127.0.0.1 or a node-local address).
        body: the encoded JSON request body (``None`` with ``GET``).
        timeout_s: socket timeout, s.
        method: ``POST`` or ``GET``.

    Returns:
        The decoded reply, or None when the reply is empty.

    Raises:
        PermanentError: HTTP 4xx (the request must change), with the first 200 bytes of the reply.
        RetryableError: HTTP 5xx, a transport error or timeout, or a reply that is not JSON.
    """
    request = urllib.request.Request(
        url, data=body, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            payload = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:200]
        cls = errors.PermanentError if 400 <= exc.code < 500 else errors.RetryableError
        raise cls(f"{url}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise errors.RetryableError(f"{url}: {exc}") from None
    if not payload.strip():
        return None
    try:
        return json.loads(payload)
    except json.JSONDecodeError:
        raise errors.RetryableError(f"{url}: reply is not JSON") from None
