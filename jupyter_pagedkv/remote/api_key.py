"""Where the server's API key comes from, and the two ways it could leak.

A key typed into a cell is saved in the notebook file and the kernel's history, so the client
takes it from the environment first: `--api-key-env NAME` (Python: `api_key_env=NAME`), else
`VLLM_API_KEY`, else `OPENAI_API_KEY`. An inline key still works and warns once. A key sent over
plain `http://` to a host that is not this machine can be read on the way, which warns too. The
key is held in an `ApiKey`, whose repr and str name only where it came from, so no message, log
record or repr of the client can print it."""
from __future__ import annotations

import ipaddress
import os
import warnings
from dataclasses import dataclass, field

ENV_NAMES = ("VLLM_API_KEY", "OPENAI_API_KEY")
_warned_inline = False


class KeyWarning(UserWarning):
    """The key may end up where others can read it."""


@dataclass(frozen=True)
class ApiKey:
    """A secret and where it came from; only `header()` shows the secret."""

    secret: str = field(repr=False)
    source: str

    def header(self) -> str:
        return f"Bearer {self.secret}"

    def __str__(self) -> str:
        return f"the API key from {self.source}"


def resolve(inline: str | None = None, env_name: str | None = None) -> ApiKey | None:
    """The key to send: inline (warned once), a named variable (which must be set), then
    VLLM_API_KEY, then OPENAI_API_KEY; None when there is none."""
    if inline is not None and env_name is not None:
        raise ValueError("give --api-key-env NAME or --api-key, not both (prefer --api-key-env)")
    if inline is not None:
        if not isinstance(inline, str) or not inline:
            raise ValueError("api_key must be non-empty text (better: set VLLM_API_KEY)")
        _warn_inline()
        return ApiKey(inline, "the notebook (--api-key)")
    if env_name is not None:
        if not isinstance(env_name, str) or not env_name.strip():
            raise ValueError("--api-key-env takes the name of an environment variable, e.g. VLLM_API_KEY")
        if not os.environ.get(env_name):
            raise ValueError(f"environment variable {env_name} is not set (or empty): set it where the "
                             f"kernel starts, or name another with --api-key-env")
        return ApiKey(os.environ[env_name], env_name)
    for name in ENV_NAMES:
        if os.environ.get(name):
            return ApiKey(os.environ[name], name)
    return None


def for_server(inline: str | None, env_name: str | None, scheme: str, host: str) -> ApiKey | None:
    """The key a client of scheme://host sends (`resolve`), warned about if it would be exposed."""
    key = resolve(inline, env_name)
    warn_if_exposed(key, scheme, host)
    return key


def _warn_inline() -> None:
    global _warned_inline
    if not _warned_inline:
        _warned_inline = True
        warnings.warn("an API key given inline (--api-key) is saved in the notebook and its history: set "
                      "VLLM_API_KEY where the kernel starts, or pass --api-key-env NAME", KeyWarning, stacklevel=4)


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(key: ApiKey | None, scheme: str, host: str) -> None:
    """A key about to travel unencrypted to another machine: say so (it is still sent)."""
    if key is not None and scheme == "http" and not is_loopback(host):
        warnings.warn(f"{key} will travel unencrypted over http:// to {host}: use https:// for a "
                      f"server on another machine", KeyWarning, stacklevel=3)
