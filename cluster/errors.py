"""Readable causes of failures that crossed Ray (which wraps them in actor/task errors)."""
from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CAUSE = re.compile(r"^(\w+(?:Error|Exception|Exit)): (.+)$")


def root_cause(exc: BaseException) -> str:
    """``"FileNotFoundError: model 'x' is ..."`` rather than three screens of Ray wrapping."""
    seen = set()
    while getattr(exc, "cause", None) is not None and id(exc) not in seen:   # RayTaskError.cause
        seen.add(id(exc))
        exc = exc.cause
    text = _ANSI.sub("", str(exc))
    causes = [m for line in text.splitlines() if (m := _CAUSE.match(line.strip()))]
    if causes:
        name, msg = causes[-1].groups()
        return f"{name}: {msg}"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"{type(exc).__name__}: {first}"[:500]


class Refused(Exception):
    """A request the frontend will not (or can no longer) serve; each API maps ``code`` onto its
    own status (gRPC ``StatusCode[code.upper()]``, an HTTP status in ``http_api``)."""

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code            # invalid_argument | resource_exhausted | already_exists | unavailable | not_found
        self.message = message
        self.field = field          # the offending request field, when one is to blame
