"""Tenants on a server: `tenant=` travels as vLLM's `cache_salt`, or is refused in one line.

vLLM 0.9 and later mix a request's `cache_salt` into the hash of its first prefix-cache block, so
only requests with the same salt share cached blocks: our `prefix_cache_scope="tenant"`. The salt
is per request, so there is no `"global"` scope remotely: `tenant=` always isolates the tenant's
prefixes, and requests without it share the server's common cache. Older vLLM releases (and
other OpenAI-compatible servers) accept unknown body fields and ignore them, so an unsupported
salt would be dropped silently; hence the version is checked before anything is sent, and a 400
that names the field (vLLM 0.9 on its V0 engine) is reworded. The salt is the tenant name as
given: on a server that others use too, a guessable name is a guessable salt.
"""
from __future__ import annotations

import re

from .errors import RemoteError, UnsupportedByServer

SALT_SINCE = (0, 9)          # the first vLLM release whose OpenAI server takes `cache_salt`
_RELEASE = re.compile(r"v?(\d+)\.(\d+)")


def release(version: str | None) -> tuple[int, int] | None:
    """'0.9.2', '0.10.1rc1', '0.9.1.dev238+g0a1b2c.cpu' -> (major, minor); None if unreadable."""
    m = _RELEASE.match(version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_salt_support(url: str, version: str | None) -> None:
    """Raise one line unless the server's reported version honours `cache_salt`."""
    since = ".".join(map(str, SALT_SINCE))
    leave = "or leave tenant= out (its requests then share the server's prefix cache)"
    found = release(version)
    if version is None:
        why = (f"reports no vLLM version (/version), so tenant= cannot be sent: only vLLM >= {since} "
               f"isolates a tenant's prefixes (cache_salt); use one")
    elif found is None:
        why = (f"reports version {version!r}, not a vLLM release: cannot tell whether it honours "
               f"cache_salt (vLLM >= {since}); upgrade vLLM")
    elif found < SALT_SINCE:
        why = (f"runs vLLM {version}, which ignores cache_salt (added in {since}), so tenant= would "
               f"not isolate prefixes there: upgrade vLLM to >= {since}")
    else:
        return
    raise UnsupportedByServer(f"{url} {why}, {leave}")


def salt_refused(url: str, version: str | None, message: str) -> RemoteError:
    """A server's 400 about `cache_salt` (vLLM 0.9 on its V0 engine) as one line saying what to do."""
    return RemoteError(f"{url} (vLLM {version or '?'}) refused tenant= as cache_salt: {message}; run "
                       f"vLLM >= {'.'.join(map(str, SALT_SINCE))} on its V1 engine, or leave tenant= out")
