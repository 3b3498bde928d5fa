"""Which tenant the current RPC acts for.

Without authentication (loopback, or --insecure-no-auth) every call is tenant "default".
The auth interceptor (service/auth.py) sets `CURRENT_TENANT` for the call (wrapping the
handler, so it runs in the handler's thread); servicer code asks `current_tenant()` and
passes the value down — nothing below the servicer knows where it came from.
"""

from __future__ import annotations

import contextvars

DEFAULT_TENANT = "default"
CURRENT_TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("fxport_tenant", default=DEFAULT_TENANT)


def current_tenant(_context: object = None) -> str:
    return CURRENT_TENANT.get()
