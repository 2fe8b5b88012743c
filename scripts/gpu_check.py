"""The GPU check's command: ``python scripts/gpu_check.py [--quick] [--only S,...] [--out FILE]``.

The check itself is the package beside this file, scripts/gpu_check/ (one module per section; its
docstring lists them and every option). This file only makes it runnable from a bare checkout:
on a GPU image where ssmkit is not installed, the repository root goes on sys.path first.
"""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("ssmkit") is None:  # a bare GPU image: the checkout, nothing installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_check import main  # noqa: E402  (scripts/gpu_check/: this file's folder is on sys.path)

if __name__ == "__main__":
    sys.exit(main())
