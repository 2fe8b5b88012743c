"""``python -m ssmkit`` = the ``ssmkit`` command."""

from .cli import main

main()
