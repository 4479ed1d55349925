"""Security: TLS contexts, SCRAM-SHA-256 logins, signed tokens, ACLs (docs/security.md).

- :mod:`.config` the settings every server and client shares (flags ``--tls-*``, ``--auth``).
- :mod:`.tls` SSL contexts; :mod:`.certs` a development CA (``sbpstream certs init``).
- :mod:`.tokens` HMAC-signed tokens the PM issues and every server verifies without a round trip.
- :mod:`.acl` operations, resources, rules and the permission check.
- :mod:`.scram` SCRAM-SHA-256 credentials and the server side of the exchange (``scramp``).
- :mod:`.records` user and ACL records as the PM keeps them in its metadata.
- :mod:`.gate` the server side: who may send what on a connection, per item for batches.
- :mod:`.pmauth` the PM's AUTHENTICATE, MANAGE_USERS and MANAGE_ACLS handlers.
- :mod:`.client` the client side: log in, present a token, renew it before it expires.
- :mod:`.setup` a server's security from its settings (its flags: sbpstream/cli/security.py);
  :mod:`.bootstrap` the first admin, made with the cluster secret.
"""
