"""What a learner sees: the student copy of notebook 00 and of an exercise notebook (papers/01_s4)
opened in a real JupyterLab, driven by headless Chromium (Debian's ``chromium`` package, through
playwright; nothing is downloaded), each run with *Run > Run All Cells*.

The copies are built by ``ssmkit workbook build --for student`` into a temporary folder, with the
CI parameters (params/ci.yaml, params/papers-ci.yaml: the keys each notebook declares) injected the
way papermill injects them, without executing anything. JupyterLab runs on a free localhost port
with a token, its kernel this interpreter with the checkout on PYTHONPATH, its settings, workspaces
and kernels in the temporary folder (the user's own are not read) and its network checks off.

Each notebook must end with every code cell executed, the kernel idle, no error output and no
traceback on stderr, a figure rendered as an image (01_s4), each unanswered exercise reported as
"not done yet", and, where the notebook builds an ipywidgets control, the widget rendered. A
full-height screenshot of each notebook (and one of each widget) is written to runs/browser/ (or
``$SSMKIT_BROWSER_SHOTS``); the pytest summary names the folder.

Without /usr/bin/chromium or playwright the test is skipped with the command that installs it;
with ``SSMKIT_REQUIRE_BROWSER=1`` (set by .ci/run) it fails instead, so CI never skips it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import ROOT

CHROMIUM = Path("/usr/bin/chromium")
INSTALL = "sudo apt-get install -y chromium"
# the copies under test and the CI parameters each takes (the keys it declares)
NOTEBOOKS = {
    "notebooks/00_setup.ipynb": "params/ci.yaml",
    "papers/01_s4.ipynb": "params/papers-ci.yaml",
}
SHOTS = Path(os.environ.get("SSMKIT_BROWSER_SHOTS") or ROOT / "runs" / "browser")
# Chromium's background services reach for the network, which this machine's is closed to
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SERVER_START_S = 90  # JupyterLab answering /api/status
RUN_ALL_S = 300  # both notebooks' Run All, from the first click to the last idle kernel
# the notebook builds an ipywidgets control: a widget must render
WIDGET_SOURCE = re.compile(r"\bipywidgets\b|\bexplore\w*\(")
NOT_DONE = "not done yet"


def missing(what: str, install: str):
    if os.environ.get("SSMKIT_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{what} missing and SSMKIT_REQUIRE_BROWSER=1: {install}")
    pytest.skip(f"{what} missing: {install}")


def requirements():
    if not CHROMIUM.exists():
        missing(f"Chromium ({CHROMIUM})", INSTALL)
    for module in ("playwright", "jupyterlab", "papermill", "ipywidgets"):
        if importlib.util.find_spec(module) is None:  # not imported: seconds on a busy machine
            missing(f"python package {module}", 'pip install -e ".[dev,workbook]"')


def build_copies(out: Path) -> Path:
    """The student copies of NOTEBOOKS in ``out/student``, CI parameters injected."""
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    from ssmkit import cli, workbook

    student = out / "student"
    cli.main(["workbook", "build", "--for", "student", str(student), *NOTEBOOKS])
    for rel, params in NOTEBOOKS.items():
        path = student / rel
        declared = workbook.declared_parameters(path)
        ci = workbook.load_params_file(ROOT / params)
        values = {k: v for k, v in ci.items() if k in declared}
        values["out_dir"] = str(out / "outputs" / path.stem)
        nb = parameterize_notebook(load_notebook_node(str(path)), values)
        nbformat.write(nb, path)
    return student


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jupyter_home(base: Path) -> dict:
    """Environment of a JupyterLab that reads nothing of the user's: its own data (kernels),
    config, runtime, settings and workspace folders under ``base``."""
    dirs = {name: base / name for name in ("data", "config", "runtime", "settings", "workspaces")}
    for d in dirs.values():
        d.mkdir(parents=True)
    kernel = dirs["data"] / "kernels" / "python3"
    kernel.mkdir(parents=True)
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # a learner's kernel: an unanswered exercise prints "not done yet" (the suite's strict mode
    # would raise it)
    env["SSMKIT_EXERCISES"] = "lenient"
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
        "env": env,
    }
    (kernel / "kernel.json").write_text(json.dumps(spec))
    # every cell in the DOM (the default windowing leaves cells out of view unrendered), no
    # news or update checks
    settings = {
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification": {
            "fetchNews": "false",
            "checkForUpdates": False,
        },
    }
    for plugin, values in settings.items():
        f = dirs["settings"] / f"{plugin}.jupyterlab-settings"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(values))
    return {
        **os.environ,
        **env,
        "JUPYTER_DATA_DIR": str(dirs["data"]),
        "JUPYTER_PATH": str(dirs["data"]),
        "JUPYTER_CONFIG_DIR": str(dirs["config"]),
        "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
        "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]),
        "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]),
    }


class Lab:
    """JupyterLab serving ``root`` on a free localhost port; stopped (with its kernels) by
    :meth:`stop`."""

    def __init__(self, root: Path, base: Path):
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.log = base / "jupyterlab.log"
        args = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={root}",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabServerApp.extension_manager=readonly",
        ]
        if os.geteuid() == 0:
            args.append("--ServerApp.allow_root=True")
        env = jupyter_home(base)
        with open(self.log, "wb") as log:
            # its own process group: stop() ends the server and every kernel it started
            self.proc = subprocess.Popen(
                args,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"JupyterLab exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(
                    f"{self.url}/api/status?token={self.token}", timeout=5
                ) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"JupyterLab not answering after {SERVER_START_S} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        try:  # kernels still alive in the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# The notebook's state as the learner sees it: each code cell's prompt ("[3]:", "[*]:", "[ ]:"),
# the kernel's status, the text of error outputs and of stderr, what each cell printed
STATE_JS = """() => {
  const cells = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')];
  const mime = kind => `[data-mime-type="application/vnd.jupyter.${kind}"]`;
  const text = (el, sel) => [...el.querySelectorAll(sel)].map(e => e.innerText);
  const indicator = document.querySelector('.jp-Notebook-ExecutionIndicator');
  return {
    kernel: indicator ? indicator.getAttribute('data-status') : null,
    prompts: cells.map(c => {
      const p = c.querySelector('.jp-InputArea-prompt');
      return p ? p.innerText.trim() : '';
    }),
    errors: cells.map(c => text(c, mime('error')).join('\\n')),
    stderr: cells.map(c => text(c, mime('stderr')).join('\\n')),
    stdout: cells.map(c => text(c, '.jp-OutputArea-output').join('\\n')),
    images: document.querySelectorAll('.jp-Notebook .jp-RenderedImage img').length,
  };
}"""


def wait_for_kernel(page, lab: Lab, rel: str) -> None:
    """Until the notebook's kernel has started (the server has a session for it) and is idle, in
    the server's view and the page's, twice in a row (the page shows "idle" before the kernel
    starts, and a Run All then asks which kernel to start)."""
    deadline, seen = time.monotonic() + SERVER_START_S, 0
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{lab.url}/api/sessions?token={lab.token}", timeout=5) as r:
            sessions = json.load(r)
        kernel = next((s["kernel"] for s in sessions if s["path"] == rel), None)
        idle = kernel and kernel["execution_state"] == "idle"
        page_idle = page.evaluate(STATE_JS)["kernel"] == "idle"
        seen = seen + 1 if idle and page_idle else 0
        if seen >= 2:
            return
        page.wait_for_timeout(500)
    raise AssertionError(f"{rel}: its kernel not idle after {SERVER_START_S} s:\n{lab.tail()}")


def open_notebook(page, lab: Lab, rel: str, workspace: str) -> None:
    """Open the notebook ``rel`` in a JupyterLab workspace of its own (two tabs of one workspace
    would fight over it), its file browser folded away (the notebook's full width)."""
    url = f"{lab.url}/lab/workspaces/{workspace}/tree/{rel}?token={lab.token}&reset"
    page.goto(url, wait_until="commit")


def run_all(page, lab: Lab, rel: str) -> None:
    """Once its kernel is idle: Run > Run All Cells, until the first cell is queued or running."""
    page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=90_000)
    page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current").click()
    wait_for_kernel(page, lab, rel)
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-Notebook .jp-InputArea-prompt')]"
        ".some(p => /\\[(\\*|\\d+)\\]/.test(p.innerText))",
        timeout=30_000,
    )


def finished(page, rel: str, deadline: float) -> dict:
    """The notebook's state once no cell is queued or running and its kernel is idle."""
    settled = 0
    while time.monotonic() < deadline:
        state = page.evaluate(STATE_JS)
        busy = state["kernel"] != "idle" or any("*" in p for p in state["prompts"])
        settled = 0 if busy else settled + 1
        if settled >= 2:  # idle twice in a row: not a gap between two cells
            return state
        page.wait_for_timeout(500)
    raise AssertionError(f"{rel}: Run All not finished after {RUN_ALL_S} s: {state['prompts']}")


def full_screenshot(page, path: Path) -> None:
    """The whole notebook in one image: the page made as tall as the notebook's content and the
    notebook scrolled to its top."""
    scroller = "document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer')"
    height = page.evaluate(f"() => {scroller}.scrollHeight")
    width = page.viewport_size["width"]
    page.set_viewport_size({"width": width, "height": min(int(height) + 150, 16_000)})
    page.evaluate(f"() => {{ {scroller}.scrollTop = 0; }}")
    page.wait_for_timeout(500)
    page.screenshot(path=str(path))
    page.set_viewport_size({"width": width, "height": 900})


def code_cells(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def check_notebook(rel: str, path: Path, state: dict) -> list[str]:
    """What is wrong with the notebook's state after Run All (empty when nothing is)."""
    problems = []
    code = code_cells(path)
    sources = ["".join(c["source"]) for c in code]
    exercises = [i for i, c in enumerate(code) if "exercise" in c["metadata"].get("tags", [])]
    assert len(state["prompts"]) == len(code), f"{rel}: {len(state['prompts'])} cells in the page"
    # JupyterLab renders an error output with the stderr renderer
    failed = [
        i
        for i, (e, err) in enumerate(zip(state["errors"], state["stderr"]))
        if e.strip() or "Traceback" in err
    ]
    if failed:
        problems.append(
            f"{rel}: error output in code cell(s) {failed}:\n"
            + (state["errors"][failed[0]] or state["stderr"][failed[0]])[-2000:]
        )
    unrun = [i for i, p in enumerate(state["prompts"]) if not re.search(r"\[\d+\]", p)]
    if unrun:
        problems.append(f"{rel}: {len(unrun)} of {len(code)} code cells not run: {unrun}")
    for i in exercises:
        if "check(" not in sources[i]:
            problems.append(f"{rel}: exercise (code cell {i}) does not report through check()")
        elif NOT_DONE not in state["stdout"][i]:
            problems.append(f"{rel}: exercise (code cell {i}) does not print {NOT_DONE!r}")
    if any("plots." in s for s in sources) and not state["images"]:
        problems.append(f"{rel}: no figure rendered as an image")
    return problems


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on the student copies (started first: it boots while they are built)."""
    requirements()
    (tmp_path / "student").mkdir()
    server = Lab(tmp_path / "student", tmp_path / "jupyter")
    try:
        student = build_copies(tmp_path)
        server.wait_ready()
        yield server, student
    finally:
        server.stop()


@pytest.mark.slow
def test_student_copies_run_all_in_jupyterlab(lab, record_property):
    """Both notebooks at once, each in its own tab: their page loads, kernel starts and runs
    overlap."""
    from playwright.sync_api import sync_playwright

    server, student = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    record_property("screenshots", str(SHOTS))
    problems, times, started = [], {}, time.monotonic()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            pages = {
                rel: browser.new_page(viewport={"width": 1280, "height": 900}) for rel in NOTEBOOKS
            }
            for i, (rel, page) in enumerate(pages.items()):
                open_notebook(page, server, rel, f"browser-test-{i}")
            deadline = time.monotonic() + RUN_ALL_S
            for rel, page in pages.items():
                name = Path(rel).stem
                try:
                    run_all(page, server, rel)
                except Exception:
                    page.screenshot(path=str(SHOTS / f"{name}-failed.png"))
                    raise
            for rel, page in pages.items():
                path, name = student / rel, Path(rel).stem
                try:
                    state = finished(page, rel, deadline)
                except Exception:
                    page.screenshot(path=str(SHOTS / f"{name}-failed.png"))
                    raise
                times[name] = time.monotonic() - started
                full_screenshot(page, SHOTS / f"{name}.png")
                problems += check_notebook(rel, path, state)
                if any(WIDGET_SOURCE.search("".join(c["source"])) for c in code_cells(path)):
                    # a rendered widget view (a failed one is a text repr or an error line)
                    widgets = page.locator(".jp-OutputArea-output:has(.jupyter-widgets)")
                    if widgets.count():
                        widgets.first.scroll_into_view_if_needed()
                        widgets.first.screenshot(path=str(SHOTS / f"{name}-widget.png"))
                    else:
                        problems.append(f"{rel}: builds an ipywidgets control, none rendered")
                # its kernel stopped once checked (a widget needs it): the other run gets the CPU
                page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Kernel$")).click()
                page.locator(
                    ".lm-Menu-itemLabel", has_text=re.compile(r"^Shut Down Kernel$")
                ).click()
        finally:
            browser.close()
    elapsed = time.monotonic() - started
    each = ", ".join(f"{name} done at {t:.0f} s" for name, t in times.items())
    print(f"browser: {elapsed:.0f} s ({each}); screenshots in {SHOTS}")
    assert not problems, "\n".join(problems) + f"\nJupyterLab log:\n{server.tail()}"
