"""API keys: `Authorization: Bearer <key>` must carry one of the configured keys (none configured = open)."""
from __future__ import annotations

import hmac
import os
from collections.abc import Iterable

from .errors import ApiError


def configured_keys(flag_keys: Iterable[str], environ=os.environ) -> list[str]:
    """--api-key flags plus DSPARK_API_KEYS (comma-separated); blanks dropped."""
    keys = list(flag_keys) + environ.get("DSPARK_API_KEYS", "").split(",")
    return [k.strip() for k in keys if k.strip()]


def check_authorization(header: str | None, keys: list[str]) -> None:
    if not keys:
        return
    scheme, _, token = (header or "").partition(" ")
    token = token.strip()
    # compare_digest against every key: the time taken does not reveal which prefix matched.
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
        raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                       type="invalid_request_error", code="invalid_api_key")
