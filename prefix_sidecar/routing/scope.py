"""A request's scope: the LoRA adapter it names and its cache salt (routing contract 10).

vLLM keys a block's hash by the adapter (every block) and by `cache_salt` (the first block,
which every later block chains from), so a prefix cached under one scope is a miss under
any other. A route key is therefore scoped too: the unscoped key stays as it is (an empty
scope changes nothing, so routing without adapters or salts is contract sections 1-9 as
written), and a scoped one is key() of the scope's bytes and the unscoped key, so every
sidecar agrees on a scoped prefix's home set without talking, and an adapter and the base
model never share a home by accident.

Which pods hold an adapter is routing/adapters.py's.

Complexity: one key() of at most ~1 KB per scoped request.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from prefix_sidecar import _core

# A salt is the caller's: bounded like any text of theirs that reaches a key. vLLM sets no
# limit; a tenant id or a random token is tens of bytes.
MAX_SALT_BYTES = 1024


class Scope(NamedTuple):
    adapter: str = ""  # the LoRA adapter the request's model names; "" the base model
    salt: str = ""  # vLLM's cache_salt; "" none

    @property
    def empty(self) -> bool:
        return not self.adapter and not self.salt


NO_SCOPE = Scope()


def scope_bytes(scope: Scope) -> bytes:
    """be32(len(adapter)) || adapter || be32(len(salt)) || salt, each UTF-8 (contract 10)."""
    adapter, salt = scope.adapter.encode(), scope.salt.encode()
    return len(adapter).to_bytes(4, "big") + adapter + len(salt).to_bytes(4, "big") + salt


def scoped_key(key: int, scope: Scope) -> int:
    """The route key of `key` under `scope`: `key` itself when the scope is empty, else
    key(scope_bytes(scope) || be64(key))."""
    if scope.empty:
        return key
    return _core.route_key(scope_bytes(scope) + key.to_bytes(8, "big"))


def scoped_prefix_id(text_id: str, scope: Scope) -> str:
    """A prefix's id under `scope`, from its id (SHA-256 hex of its text, contract 2): that id
    when the scope is empty, else SHA-256 hex of scope_bytes(scope) || the id's ASCII, so one
    text has one entry per scope, found without hashing the text again."""
    if scope.empty:
        return text_id
    return hashlib.sha256(scope_bytes(scope) + text_id.encode("ascii")).hexdigest()


def checked_salt(salt: object, field: str = "cache_salt") -> str:
    """A caller's salt: a string of at most MAX_SALT_BYTES UTF-8 bytes (ValueError saying
    what to fix)."""
    if not isinstance(salt, str):
        raise ValueError(f"{field} must be a string")
    if len(salt.encode("utf-8", "surrogatepass")) > MAX_SALT_BYTES:
        raise ValueError(f"{field} is over {MAX_SALT_BYTES} bytes; send a shorter salt")
    return salt
