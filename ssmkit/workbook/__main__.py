"""``python -m ssmkit.workbook run|strip ...``: the same as ``ssmkit workbook``."""

from .cli import main

main()
