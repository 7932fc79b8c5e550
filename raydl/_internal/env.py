"""Every environment variable raydl reads, read in this one place."""

from __future__ import annotations

import os

#: Address of an existing Ray cluster to join (Ray's own variable).
RAY_ADDRESS = "RAY_ADDRESS"
#: Ray's authentication mode; raydl sets it to ``token`` unless the user chose otherwise.
RAY_AUTH_MODE = "RAY_AUTH_MODE"
#: Ray's token sources, in Ray's order of precedence (the token file defaults to ~/.ray/auth_token).
RAY_AUTH_TOKEN = "RAY_AUTH_TOKEN"
RAY_AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"


def ray_address() -> str | None:
    """The cluster address from ``RAY_ADDRESS``, or ``None`` when unset or empty."""
    return os.environ.get(RAY_ADDRESS) or None


def ensure_token_auth_mode() -> bool:
    """Turn on Ray token authentication for this process unless the user set a mode.

    Returns:
        Whether token authentication is on after the call.
    """
    mode = os.environ.setdefault(RAY_AUTH_MODE, "token")
    return mode.lower() == "token"
