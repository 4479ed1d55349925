"""Users and ACL rules as the PM keeps them in its metadata (SQLite or etcd).

Both backends store opaque records by kind and key (``auth_get``/``auth_put``/``auth_delete``/
``auth_list``: :class:`AuthStore`); the rules of what a record may
be live here once. Users: key = name, value = the SCRAM credential (salted and hashed, never the
password). ACLs: key = JSON ``[principal, resource]``, value = the operations, so adding a rule
for a pair already granted merges the operations.
"""

from __future__ import annotations

import json
from typing import Final, Protocol

from sbpstream.auth import scram
from sbpstream.auth.acl import AclRule, check_principal, check_resource, format_ops, parse_ops
from sbpstream.protocol.errors import InvalidRequestError

KIND_USER: Final = "user"
KIND_ACL: Final = "acl"


class AuthStore(Protocol):
    """Opaque records by kind and key: the part of the PM's metadata store
    (:class:`~sbpstream.pm.metadata.MetadataStore`, which has these four methods) that users
    and ACLs need. Declared here, below the PM, so auth imports nothing of it."""

    async def auth_get(self, kind: str, key: str) -> str | None: ...

    async def auth_put(self, kind: str, key: str, value: str) -> None: ...

    async def auth_delete(self, kind: str, key: str) -> bool:
        """True if the record existed."""

    async def auth_list(self, kind: str) -> list[tuple[str, str]]:
        """Every (key, value) of ``kind``, by key."""


def _acl_key(principal: str, resource: str) -> str:
    return json.dumps([principal, resource], separators=(",", ":"))


class AuthRecords:
    def __init__(self, meta: AuthStore) -> None:
        self.meta = meta

    # ---- users
    async def add_user(self, name: str, password: str) -> None:
        check_principal(name)
        cred = scram.make_credential(password)
        await self.meta.auth_put(KIND_USER, name, cred.to_json())

    async def credential(self, name: str) -> scram.Credential | None:
        raw = await self.meta.auth_get(KIND_USER, name)
        return None if raw is None else scram.Credential.from_json(raw)

    async def list_users(self) -> list[str]:
        return sorted(k for k, _ in await self.meta.auth_list(KIND_USER))

    async def delete_user(self, name: str) -> None:
        """The user and every rule naming it go."""
        if not await self.meta.auth_delete(KIND_USER, name):
            raise InvalidRequestError(f"no user {name!r}")
        for r in await self.rules(name):
            await self.meta.auth_delete(KIND_ACL, _acl_key(r.principal, r.resource))

    # ---- ACL rules
    async def add_rule(self, principal: str, ops_text: str, resource: str) -> AclRule:
        check_principal(principal)
        resource = check_resource(resource)
        ops = parse_ops(ops_text)
        if await self.meta.auth_get(KIND_USER, principal) is None:
            raise InvalidRequestError(f"no user {principal!r}: add the user first")
        key = _acl_key(principal, resource)
        old = await self.meta.auth_get(KIND_ACL, key)
        if old is not None:
            ops = ops | parse_ops(old)
        await self.meta.auth_put(KIND_ACL, key, format_ops(ops))
        return AclRule(principal, ops, resource)

    async def delete_rule(self, principal: str, ops_text: str, resource: str) -> None:
        """Take ``ops_text``'s operations away (``all``: the whole rule)."""
        key = _acl_key(principal, check_resource(resource))
        old = await self.meta.auth_get(KIND_ACL, key)
        if old is None:
            raise InvalidRequestError(f"no ACL for {principal!r} on {resource!r}")
        left = parse_ops(old) - parse_ops(ops_text or "all")
        if left:
            await self.meta.auth_put(KIND_ACL, key, format_ops(left))
        else:
            await self.meta.auth_delete(KIND_ACL, key)

    async def rules(self, principal: str = "") -> list[AclRule]:
        out = []
        for key, value in await self.meta.auth_list(KIND_ACL):
            p, resource = json.loads(key)
            if not principal or p == principal:
                out.append(AclRule(p, parse_ops(value), resource))
        return sorted(out, key=lambda r: (r.principal, r.resource))
