"""`python -m covey …`, the same as the `covey` command."""

from covey.cli import main

main()
