"""``python -m ssmkit.train`` (what ``torchrun ... -m ssmkit.train`` runs): see
:mod:`ssmkit.train.cli`."""

from .cli import main

main()
