"""`python -m m27.cli` is the `m27` command."""

from m27.cli import main

main()
