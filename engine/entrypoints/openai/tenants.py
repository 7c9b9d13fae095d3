"""Tenants: API keys, the tenant each names, and what a tenant is kept apart from.

A server with API keys maps every key to a tenant. A request's tenant namespaces its job ids
(tenant B asking for tenant A's job gets 404, and cannot release A's pin) and, unless the
server shares the prefix cache, salts its prefix-cache hashes so that one tenant's prompts
never hit another's cached blocks (`cached_tokens` would otherwise reveal them). A server
without keys has no tenants: one namespace, one shared cache.

Keys come from `--api-key KEY` (tenant "default"), `--tenant NAME:KEY` (repeatable), and
`--api-keys-file PATH` (lines `KEY TENANT`; blank lines and `#` comments are skipped).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from starlette.types import Scope

DEFAULT_TENANT = "default"
# The paths a client may call without an API key.
UNAUTHENTICATED_PATHS = frozenset({"/health"})
TENANT_SCOPE_KEY = "continuum.tenant"
MAX_KEYS_FILE_BYTES = 16 * 1024 * 1024

_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_TENANT_NAME_RULE = "1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit"


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def check_tenant_name(name: str) -> str:
    """`name` if it is a valid tenant name (1 to 64 of letters, digits, `_`, `.`, `-`, not
    starting with a punctuation mark); ValueError otherwise."""
    if not _TENANT_NAME.fullmatch(name):
        raise ValueError(f"tenant name {name!r} must be {_TENANT_NAME_RULE}")
    return name


@dataclass(frozen=True)
class Tenants:
    """The server's API keys and their tenants; immutable once the server starts.

    Keys are held as SHA-256 digests, so a lookup's time does not depend on how much of a
    wrong key matches a right one. `share_prefix_cache` lets tenants hit each other's cached
    prefixes (faster for shared system prompts; the `cached_tokens` side channel is then open
    between them).
    """

    tenant_by_key_digest: Mapping[bytes, str]
    share_prefix_cache: bool = False

    def __post_init__(self) -> None:
        if not self.tenant_by_key_digest:
            raise ValueError("at least one API key is needed for tenants")
        for tenant in self.tenant_by_key_digest.values():
            check_tenant_name(tenant)
        object.__setattr__(self, "tenant_by_key_digest",
                           MappingProxyType(dict(self.tenant_by_key_digest)))

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[str, str]], *,
                   share_prefix_cache: bool = False) -> Tenants:
        """Tenants from (key, tenant) pairs; ValueError on an empty key, a bad tenant name,
        or a key given to two tenants."""
        tenant_by_digest: dict[bytes, str] = {}
        for key, tenant in pairs:
            if not key or any(c.isspace() for c in key):
                raise ValueError("an API key must be non-empty and hold no whitespace")
            check_tenant_name(tenant)
            digest = _digest(key)
            other = tenant_by_digest.get(digest, tenant)
            if other != tenant:
                raise ValueError(f"one API key is given to two tenants ({other!r} and "
                                 f"{tenant!r})")
            tenant_by_digest[digest] = tenant
        return cls(tenant_by_digest, share_prefix_cache=share_prefix_cache)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.tenant_by_key_digest.values())

    def tenant_of(self, key: bytes) -> str | None:
        """The tenant of an API key, or None for an unknown key."""
        return self.tenant_by_key_digest.get(_digest(key))

    def tenant_of_request(self, scope: Scope) -> str | None:
        """The tenant named by an HTTP request's `Authorization: Bearer <key>` header, or
        else by its `x-api-key: <key>` header (Anthropic's clients send that one), from its
        ASGI scope; None without a known key. Needs the headers only, so that a server
        checks the key before it reads the body."""
        headers = dict(scope["headers"])
        scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
        tenant = self.tenant_of(key.strip()) if scheme.lower() == b"bearer" else None
        if tenant is None and b"x-api-key" in headers:
            tenant = self.tenant_of(headers[b"x-api-key"].strip())
        return tenant


def parse_tenant_flag(value: str) -> tuple[str, str]:
    """(key, tenant) of a `--tenant NAME:KEY` value; ValueError when malformed."""
    name, sep, key = value.partition(":")
    if not sep or not key:
        raise ValueError("--tenant takes NAME:KEY (the value given has no ':' or no key)")
    if not _TENANT_NAME.fullmatch(name):
        # Not echoed: with NAME and KEY swapped, it would be the key.
        raise ValueError(f"--tenant NAME:KEY: the tenant name must be {_TENANT_NAME_RULE}")
    return key, name


def read_keys_file(path: str | Path) -> list[tuple[str, str]]:
    """(key, tenant) pairs of a keys file: `KEY TENANT` lines, blank lines and `#` comments
    skipped; ValueError naming the line that is malformed."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"the API keys file {str(path)!r} is not a regular file")
    if path.stat().st_size > MAX_KEYS_FILE_BYTES:
        raise ValueError(f"the API keys file {str(path)!r} is over {MAX_KEYS_FILE_BYTES} bytes")
    pairs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        fields = text.split()
        if len(fields) != 2:
            raise ValueError(f"{path}:{number}: expected 'KEY TENANT', got {len(fields)} fields")
        if not _TENANT_NAME.fullmatch(fields[1]):
            raise ValueError(f"{path}:{number}: the tenant name must be {_TENANT_NAME_RULE}")
        pairs.append((fields[0], fields[1]))
    return pairs


def scope_tenant(scope: Scope) -> str | None:
    """The tenant the authentication middleware found for this HTTP request (None: no keys)."""
    tenant: str | None = scope.get(TENANT_SCOPE_KEY)
    return tenant


def engine_job_id(tenant: str | None, job_id: str) -> str:
    """The engine's id of a tenant's job: the tenant's name and `/` before it, so that two
    tenants' ids never meet (tenant names hold no `/`)."""
    return job_id if tenant is None else f"{tenant}/{job_id}"


def engine_cache_salt(tenant: str | None, cache_salt: str | None, *,
                      share_prefix_cache: bool) -> str | None:
    """The salt of a request's prefix-cache hashes: the client's `cache_salt`, preceded by
    the tenant unless tenants share the cache (tenant names hold no NUL, so the first NUL
    ends the tenant's part and distinct pairs give distinct salts)."""
    if tenant is None or share_prefix_cache:
        return cache_salt
    return f"{tenant}\x00{cache_salt or ''}"
