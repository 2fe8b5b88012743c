"""The notebooks open in JupyterLab: a real ``jupyter lab`` server (the one ``make lab`` starts)
serves the Lab page, lists the workbook's notebooks, returns each one parseable, offers the kernel
its metadata names, and starts that kernel. (Execution itself is tested under papermill in
test_notebooks.py.)
"""

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import ROOT

pytest.importorskip("jupyterlab")

TOKEN = "ssmkit-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    port = free_port()
    home = tmp_path_factory.mktemp("jupyter-home")
    env = {
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "HOME": str(home),
        "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            f"--port={port}",
            "--ip=127.0.0.1",
            f"--IdentityProvider.token={TOKEN}",
            f"--ServerApp.root_dir={ROOT}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{base}/api/status?token={TOKEN}", timeout=1)
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited: {proc.stderr.read()[-2000:]}")
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("jupyter lab did not answer within 60 s")
    yield base
    proc.terminate()
    proc.wait(timeout=20)


def get(base: str, path: str, method: str = "GET"):
    req = urllib.request.Request(
        f"{base}{path}?token={TOKEN}", method=method, data=b"{}" if method == "POST" else None
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        body = resp.read().decode()
        return resp.status, body


def test_lab_serves_the_workbook(lab):
    status, page = get(lab, "/lab")
    assert status == 200 and "JupyterLab" in page
    listing = json.loads(get(lab, "/api/contents/notebooks")[1])
    names = {item["name"] for item in listing["content"]}
    expected = {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert {"00_setup.ipynb", "01_prototype_130m.ipynb"} <= names and expected <= names
    specs = json.loads(get(lab, "/api/kernelspecs")[1])["kernelspecs"]
    for name in sorted(expected):
        nb = json.loads(get(lab, f"/api/contents/notebooks/{name}")[1])
        assert nb["type"] == "notebook" and nb["content"]["cells"]
        assert nb["content"]["metadata"]["kernelspec"]["name"] in specs, (
            f"{name}: its kernel is not offered"
        )


def test_lab_starts_the_notebooks_kernel(lab):
    status, body = get(lab, "/api/kernels", method="POST")
    kernel = json.loads(body)
    assert status == 201 and kernel["name"] == "python3"
    get(lab, f"/api/kernels/{kernel['id']}", method="DELETE")
