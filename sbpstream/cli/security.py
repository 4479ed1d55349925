"""``sbpstream certs|user|acl``: the security commands of the command line (docs/security.md).

``certs init DIR`` makes a development CA, certificates and a cluster secret. ``user`` and
``acl`` manage users and ACL rules on the PM; they need a user with the ``admin`` operation
(``--user``/``--password`` or ``$SBPSTREAM_USER``/``$SBPSTREAM_PASSWORD``), or the cluster secret
itself (``--secret-file``), which is how the first admin is made.
"""

from __future__ import annotations

import secrets
import sys
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer

from sbpstream.auth.config import DEFAULT_TOKEN_TTL_S, SecurityConfig
from sbpstream.cli.app import UNSET, PmOption, TimeoutOption
from sbpstream.client import AsyncClient
from sbpstream.net.loop import run
from sbpstream.net.tls import TlsConfig
from sbpstream.protocol.errors import SbpError

T = TypeVar("T")

EXIT_ERROR = 1
EXIT_USAGE = 2

certs_app = typer.Typer(help="Development TLS certificates and cluster secret.",
                        no_args_is_help=True, rich_markup_mode=None)
user_app = typer.Typer(help="Add, list and delete users (needs admin).", no_args_is_help=True,
                       rich_markup_mode=None)
acl_app = typer.Typer(help="Add, list and delete ACL rules (needs admin).",
                      no_args_is_help=True, rich_markup_mode=None)

SecretOption = Annotated[str, typer.Option(
    "--secret-file", help="Act with the cluster secret instead of a user (makes the first "
    "admin); needs --tls-ca when the cluster runs TLS.")]


TlsCertOption = Annotated[str, typer.Option("--tls-cert", help="PEM certificate of this server.")]
TlsKeyOption = Annotated[str, typer.Option("--tls-key", help="PEM private key of --tls-cert.")]
TlsCaOption = Annotated[str, typer.Option(
    "--tls-ca", help="PEM CA that peers' certificates are verified against.")]
AuthOption = Annotated[bool, typer.Option(
    "--auth", help="Authenticate every connection (SCRAM or token) and apply ACLs.")]
SecretFileOption = Annotated[str, typer.Option(
    "--secret-file", help="The cluster secret signing tokens (PMs and data nodes only).")]
AllowRemoteOption = Annotated[bool, typer.Option(
    "--allow-remote-unauthenticated",
    help="Protected mode off: serve clients beyond loopback with auth off.")]
TlsRequireClientCertOption = Annotated[bool, typer.Option(
    "--tls-require-client-cert",
    help="Mutual TLS: refuse clients without a certificate from --tls-ca.")]
TokenTtlOption = Annotated[int, typer.Option(
    "--token-ttl-s", min=1, help="Lifetime of the tokens the PM issues.")]
AllowInsecureAuthOption = Annotated[bool, typer.Option(
    "--allow-insecure-auth",
    help="Serve --auth without TLS on an address beyond loopback (logins and tokens in clear).")]


def security_config(tls_cert: str, tls_key: str, tls_ca: str, auth: bool, secret_file: str,
                    allow_remote_unauthenticated: bool, allow_insecure_auth: bool = False,
                    require_client_cert: bool = False,
                    token_ttl_s: int = DEFAULT_TOKEN_TTL_S) -> SecurityConfig:
    """A server's security settings from its flags (docs/security.md)."""
    return SecurityConfig(TlsConfig(tls_cert, tls_key, tls_ca, require_client_cert), auth=auth,
                          secret_file=secret_file, token_ttl_s=token_ttl_s,
                          allow_remote_unauthenticated=allow_remote_unauthenticated,
                          allow_insecure_auth=allow_insecure_auth)


def _fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    text = " ".join(p.strip() for p in message.splitlines() if p.strip())  # one line
    print(f"sbpstream: error: {text}", file=sys.stderr)
    raise typer.Exit(code)


def _admin_run(pm: str, timeout_ms: int, secret_file: str,
               body: Callable[[AsyncClient], Coroutine[Any, Any, T]]) -> T:
    """``body(client)`` as the configured user, or as the cluster (``--secret-file``)."""

    async def main(token_file: str) -> T:
        client = AsyncClient(pm, retry_deadline_ms=timeout_ms,
                             request_timeout_ms=min(10_000, max(1000, timeout_ms)),
                             token_file=token_file)
        async with client:
            return await body(client)

    try:
        with tempfile.TemporaryDirectory() as tmp:
            token_file = ""
            if secret_file:  # a short-lived bootstrap *user* token (admin on *), minted here
                from sbpstream.auth.bootstrap import bootstrap_token
                from sbpstream.auth.config import read_secret

                token_file = str(Path(tmp) / "token")
                Path(token_file).write_text(bootstrap_token(read_secret(secret_file)))
            return run(main(token_file))
    except SbpError as exc:
        _fail(str(exc))
    except (ValueError, OSError) as exc:
        _fail(str(exc), EXIT_USAGE)


# ------------------------------------------------------------------------------------ certs


@certs_app.command("init")
def certs_init(
    directory: Annotated[Path, typer.Argument(help="Where to write the files.")],
    host: Annotated[list[str] | None, typer.Option(
        "--host", help="Another name or address the server certificate is valid for.")] = None,
) -> None:
    """Make a development CA, a server and a client certificate and a cluster secret."""
    from sbpstream.auth.certs import init_dev_certs

    for p in init_dev_certs(directory, host or []):
        print(p)


# ------------------------------------------------------------------------------------ users


@user_app.command("add")
def user_add(
    name: Annotated[str, typer.Argument(help="User name.")],
    password: Annotated[str, typer.Option(
        "--user-password", help="The new user's password (default: a random one, printed).")
                        ] = "",
    pm: PmOption = "", secret_file: SecretOption = "",
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Add a user (or set its password). Grant it operations with `acl add`."""
    pw = password or secrets.token_urlsafe(18)
    _admin_run(pm, timeout_ms, secret_file, lambda c: c.add_user(name, pw))
    print(f"user {name} added" + ("" if password else f"; password: {pw}"))


@user_app.command("list")
def user_list(pm: PmOption = "", secret_file: SecretOption = "",
              timeout_ms: TimeoutOption = UNSET) -> None:
    for u in _admin_run(pm, timeout_ms, secret_file, lambda c: c.list_users()):
        print(u)


@user_app.command("delete")
def user_delete(name: Annotated[str, typer.Argument(help="User name.")],
                pm: PmOption = "", secret_file: SecretOption = "",
             timeout_ms: TimeoutOption = UNSET) -> None:
    """Delete a user and every ACL rule naming it."""
    _admin_run(pm, timeout_ms, secret_file, lambda c: c.delete_user(name))
    print(f"user {name} deleted")


# ------------------------------------------------------------------------------------- ACLs


@acl_app.command("add")
def acl_add(
    principal: Annotated[str, typer.Argument(help="User name.")],
    operations: Annotated[str, typer.Argument(
        help="create,delete,update,trim,describe,append,fetch,admin, or all.")],
    resource: Annotated[str, typer.Argument(help="*, stream:ID or prefix:TEXT.")],
    pm: PmOption = "", secret_file: SecretOption = "",
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Grant operations on a resource (takes effect at the user's next token)."""
    _admin_run(pm, timeout_ms, secret_file, lambda c: c.add_acl(principal, operations, resource))
    print(f"granted {operations} on {resource} to {principal}")


@acl_app.command("list")
def acl_list(principal: Annotated[str, typer.Argument(help="Only this user's rules.")] = "",
             pm: PmOption = "", secret_file: SecretOption = "",
             timeout_ms: TimeoutOption = UNSET) -> None:
    for p, ops, res in _admin_run(pm, timeout_ms, secret_file, lambda c: c.list_acls(principal)):
        print(f"{p}\t{ops}\t{res}")


@acl_app.command("delete")
def acl_delete(
    principal: Annotated[str, typer.Argument(help="User name.")],
    resource: Annotated[str, typer.Argument(help="*, stream:ID or prefix:TEXT.")],
    operations: Annotated[str, typer.Option("--ops", help="Only these operations.")] = "all",
    pm: PmOption = "", secret_file: SecretOption = "",
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Take operations (default: all) on a resource away from a user."""
    _admin_run(pm, timeout_ms, secret_file, lambda c: c.delete_acl(principal, resource, operations))
    print(f"revoked {operations} on {resource} from {principal}")


def add_commands(app: typer.Typer) -> None:
    app.add_typer(certs_app, name="certs")
    app.add_typer(user_app, name="user")
    app.add_typer(acl_app, name="acl")


# ------------------------------------------------------------------------------- up --secure

ADMIN_USER = "admin"


def secure_certs(directory: Path) -> Path:
    """DIR/certs (absolute), made by ``certs init`` the first time: kept across restarts of
    ``up``."""
    from sbpstream.auth.certs import init_dev_certs
    from sbpstream.auth.config import CA_FILE
    from sbpstream.private_files import private_dir

    certs = private_dir(directory.absolute()) / "certs"
    if not (certs / CA_FILE).is_file():
        init_dev_certs(certs)
    return certs


ACL_EXAMPLE_HEADER = ("Try an ACL: alice may append, fetch and describe the streams whose "
                      "names start with orders. (as admin, after the exports):")


def acl_example() -> list[str]:
    """Commands that run as printed after the exports (tests/test_cli_secure.py runs them):
    ``prefix:`` matches stream names, so the example names its stream. Alice's password is
    new at each start, like the admin's."""
    pw = secrets.token_hex(8)  # never starts with "-" (it follows an option)
    alice = f"SBPSTREAM_USER=alice SBPSTREAM_PASSWORD={pw}"
    return [
        "",
        ACL_EXAMPLE_HEADER,
        "  sbpstream stream create orders.eu",
        f"  sbpstream user add alice --user-password {pw}",
        "  sbpstream acl add alice append,fetch,describe 'prefix:orders.'",
        f"  echo hello | {alice} sbpstream produce --stream orders.eu",
        f"  {alice} sbpstream consume --stream orders.eu --from earliest",
    ]


def print_admin_credentials(cluster: Any) -> None:
    """(Re)make the admin user with a fresh password and say how to use it."""
    from sbpstream.auth.bootstrap import bootstrap_admin
    from sbpstream.auth.config import CA_FILE

    password = secrets.token_urlsafe(18)
    certs: Path = cluster.secure.absolute()
    run(bootstrap_admin(cluster.pm_address, certs, ADMIN_USER, password))
    lines = [
        "",
        "Security is on: TLS everywhere, every connection authenticated, ACLs default deny.",
        "Admin credentials (all operations on *; password new at each start):",
        f"  export SBPSTREAM_USER={ADMIN_USER}",
        f"  export SBPSTREAM_PASSWORD={password}",
        f"  export SBPSTREAM_TLS_CA={certs / CA_FILE}",
        *acl_example(),
        "",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
