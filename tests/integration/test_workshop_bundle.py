"""``make workshop-bundle`` (scripts/workshop_bundle.py), offline: the bundle is built without its
download step, and its install.sh installs ssmkit with ``pip install --no-index --find-links``
into a fresh venv where pip can reach no index.

The wheels ``pip download`` would add (torch, JupyterLab, ...) need the network; in their place the
fresh venv sees this venv's site-packages through a .pth file (read as a path only: this venv's
own editable ssmkit is not on it), so pip finds them installed and must take nothing else from an
index. The oracle: ssmkit imports in the new venv from the unpacked source, at HEAD's version, and
``ssmkit workbook`` finds the bundle's notebooks.
"""

from __future__ import annotations

import importlib.util
import os
import site
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.skipif(
    not (ROOT / ".git").exists() or sys.platform == "win32", reason="needs a git checkout, bash"
)

_spec = importlib.util.spec_from_file_location("bundle", ROOT / "scripts" / "workshop_bundle.py")
bundle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bundle)


@pytest.mark.slow
def test_bundle_installs_with_no_index(tmp_path):
    out = tmp_path / "bundle"
    sizes = bundle.build(out, download=False)
    assert set(sizes) == {bundle.MARK, "wheelhouse", "ssmkit-src.tar.gz", "install.sh"}
    (wheel,) = (out / "wheelhouse").glob("ssmkit-0.1.0-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    (new_site,) = venv.glob("lib/python*/site-packages")
    (new_site / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {  # no PIP_FIND_LINKS / PIP_EXTRA_INDEX_URL of this machine, no PYTHONPATH to ssmkit
        **{k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"},
        "VENV": str(venv),
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # nothing listens: any index use fails
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    res = subprocess.run(
        ["bash", out / "install.sh", tmp_path / "class"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Looking in links: " + str(out / "wheelhouse") + "\n" in res.stdout  # and nothing else
    assert f"ssmkit installed from {tmp_path / 'class' / 'ssmkit' / '__init__.py'}" in res.stdout
    assert (tmp_path / "class" / "notebooks" / "00_setup.ipynb").is_file()
    assert (tmp_path / "class" / "params" / "workshop.yaml").is_file()
    check = subprocess.run(
        [
            venv / "bin" / "python",
            "-c",
            "import importlib.metadata as m, ssmkit.workbook as w; "
            "print(m.version('ssmkit'), w.find_notebooks()[0])",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path / "class",
        env=env,
        timeout=120,
    )
    assert check.stdout.split() == ["0.1.0", "notebooks/00_setup.ipynb"], check.stderr[-2000:]
    assert wheel.stat().st_size > 10_000
