"""``python -m sbpstream.pm``: the same command, flags and defaults as ``sbpstream pm``
(defined once, in sbpstream/cli/servers.py; settings also from ``--config FILE`` and
``SBPSTREAM_*`` variables, see docs/operations.md)."""

from sbpstream.cli.servers import server_main

if __name__ == "__main__":
    server_main("pm")
