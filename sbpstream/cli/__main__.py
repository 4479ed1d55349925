"""``python -m sbpstream.cli ...``: the same as the ``sbpstream`` command."""

from sbpstream.cli import main

if __name__ == "__main__":
    main()
