"""The quickstart notebook in a real browser: JupyterLab on localhost, headless Chromium driven by Playwright.

Runs every cell, clicks the dashboard's "Train tick" button and checks that the buffer view and the verdict table
changed; then clicks "Start" for a long background run, sees the progress line move, "Pause" (it stops moving) and
"Stop". With ``ASYNCRL_SCREENSHOT=docs/dashboard.png`` it also saves a screenshot of the dashboard (the README's
picture). Skips, saying so, only when there is no browser to drive (Chromium or Playwright missing); anything
else that goes wrong (JupyterLab not starting, the notebook not running, the dashboard not appearing) fails.

Reliability (see FACTS "Widgets in a real browser"): the notebook has a kernelspec (no kernel dialog); the news
notice is off and notebook windowing is off (every cell stays in the DOM) through user settings; JupyterLab, the
kernel and matplotlib write only under a temporary HOME; "run all cells" is retried when it is ignored.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]  # the whole notebook, then the dashboard: about a minute

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
CHROMIUM = os.environ.get("ASYNCRL_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--disable-background-networking", "--disable-component-update", "--disable-default-apps", "--disable-sync",
    "--disable-extensions", "--disable-breakpad", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
    "--metrics-recording-only", "--mute-audio", "--password-store=basic",
]
SETTINGS = {  # JupyterLab user settings: no news notice, no update check, every cell rendered
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}
SERVER_TIMEOUT_S = 60
FIRST_CELL_TIMEOUT_S = 90  # the imports cell
RUN_TIMEOUT_S = float(os.environ.get("ASYNCRL_BROWSER_RUN_TIMEOUT_S", 240))  # the whole notebook on a busy 2-core
# machine (about 30 s when idle); the environment variable lets a check of this test make it time out
STALL_S = 90  # no cell's prompt changed for this long: the page is stuck (its slowest cell takes ~25 s on 2 cores)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a free localhost port, serving a copy of the quickstart notebook; yields its URL."""
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    tmp = tmp_path_factory.mktemp("lab")
    work, home = tmp / "work", tmp / "home"
    work.mkdir()
    home.mkdir()
    shutil.copy(NOTEBOOK, work / "quickstart.ipynb")
    settings = tmp / "settings"
    for name, values in SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = dict(
        os.environ,
        HOME=str(home),
        JUPYTER_CONFIG_DIR=str(tmp / "config"),
        JUPYTER_DATA_DIR=str(tmp / "data"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(settings),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
        IPYTHONDIR=str(tmp / "ipython"),
        MPLCONFIGDIR=str(tmp / "mpl"),
        MPLBACKEND="Agg",
        HF_HUB_OFFLINE="1",
        # the python3 kernelspec runs "python" from PATH: make it this environment's
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    )
    port, token = _free_port(), "asyncrl-browser-test"
    log = open(tmp / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}",
         "--LabApp.expose_app_in_browser=True", "--LabApp.extension_manager=readonly",
         "--ServerApp.terminals_enabled=False", "--allow-root"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not start:\n{(tmp / 'jupyterlab.log').read_text()[-3000:]}")
            time.sleep(0.3)
        yield {"url": url, "token": token, "log": tmp / "jupyterlab.log"}
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def _first_prompt(page) -> str:
    return page.locator(".jp-CodeCell .jp-InputArea-prompt").first.inner_text().strip()


def _command(page, command: str, args: dict | None = None) -> None:
    """Start a JupyterLab command without awaiting its promise (run-all's resolves only when every cell is done, and
    never when the request is ignored)."""
    page.evaluate("([command, args]) => { window.jupyterapp.commands.execute(command, args); }", [command, args or {}])


def _open_notebook(page, lab) -> None:
    """Open JupyterLab, wait until it knows the kernelspecs, then open the notebook and wait for its kernel. (Opened
    straight from its URL on a slow machine, the notebook can race the kernelspec request and raise a "Select
    Kernel" dialog; should one appear anyway, accept it: it offers the notebook's own python3.)"""
    # The notebook's session (and its kernel) exists before the page opens, so JupyterLab connects to it instead of
    # starting a kernel of its own while it still restores, which raced into a second kernel and a swap under the
    # queued cells.
    request = urllib.request.Request(
        f"{lab['url']}/api/sessions?token={lab['token']}", method="POST",
        data=json.dumps({"path": "quickstart.ipynb", "name": "quickstart.ipynb", "type": "notebook",
                         "kernel": {"name": "python3"}}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status in (200, 201), response.status
    page.goto(f"{lab['url']}/lab?reset&token={lab['token']}")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.commands.hasCommand('docmanager:open')",
                           timeout=90_000)
    page.evaluate("() => { window.jupyterapp.restored.then(() => { window.asyncrlRestored = true; }); }")
    page.wait_for_function(
        "() => window.asyncrlRestored && window.jupyterapp.serviceManager.kernelspecs.specs"
        " && window.jupyterapp.serviceManager.kernelspecs.specs.kernelspecs.python3",
        timeout=90_000,
    )
    notebook = page.locator(".jp-NotebookPanel")
    for _attempt in range(3):
        _command(page, "docmanager:open", {"path": "quickstart.ipynb"})
        try:
            notebook.first.wait_for(timeout=20_000)
            break
        except Exception:  # playwright's TimeoutError: ask again
            continue
    idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")
    dialog = page.locator(".jp-Dialog")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if dialog.count():
            dialog.first.locator(".jp-Dialog-button.jp-mod-accept").click()
            time.sleep(1)
        elif idle.count():
            time.sleep(1)  # still idle and no late dialog: ready
            if idle.count() and not dialog.count():
                return
        time.sleep(0.25)
    pytest.fail(f"the notebook's kernel did not become idle; server log:\n{lab['log'].read_text()[-3000:]}")


def _dismiss_dialogs(page) -> None:
    """Close any JupyterLab dialog with its cancel button; for "Select Kernel" that changes nothing."""
    for _ in range(3):
        dialog = page.locator(".jp-Dialog")
        if not dialog.count():
            return
        dialog.first.locator(".jp-Dialog-button.jp-mod-reject").click()
        time.sleep(0.3)


def _run_all(page) -> None:
    """Run all cells and wait until the first code cell has finished. JupyterLab occasionally ignores the request
    right after the kernel goes idle (the prompt stays ``[ ]:``), and once in a while its session swaps kernels just
    after start, leaving the queued cells at ``[*]:`` on a kernel that is gone; in both cases ask again."""
    for _attempt in range(3):
        _command(page, "notebook:run-all-cells")
        started = time.monotonic()
        while time.monotonic() - started < FIRST_CELL_TIMEOUT_S:
            prompt = _first_prompt(page)
            if re.fullmatch(r"\[\d+\]:", prompt):
                return
            if prompt in ("[ ]:", "") and time.monotonic() - started > 10:
                break  # ignored
            time.sleep(0.25)
    pytest.fail(f"'run all cells' did not run the first cell in 3 attempts (its prompt: {_first_prompt(page)!r})")


def _wait_for_dashboard(page, lab) -> None:
    """Until the dashboard is drawn; fail early, with the error, if a cell raised. When JupyterLab swapped the
    session's kernel under the queued cells (every prompt back to ``[ ]:``, the kernel idle), close its "Select
    Kernel" dialog and run all cells again (twice at most)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    dashboard = page.locator(".asyncrl-dashboard .asyncrl-buffer img")
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']")
    idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")
    prompts = page.locator(".jp-CodeCell .jp-InputArea-prompt")
    reset_since, reruns = None, 0
    seen, moved = None, time.monotonic()
    while time.monotonic() < deadline:
        if errors.count():
            pytest.fail(f"a notebook cell raised:\n{errors.first.inner_text()[-3000:]}")
        if dashboard.count() and dashboard.first.get_attribute("src"):
            return
        # A page whose cells stopped moving (seen in full-suite runs: the whole RUN_TIMEOUT_S lost before the
        # second try) fails now, so the caller's second try in a fresh page starts without waiting it out.
        if (now := prompts.all_inner_texts()) != seen:
            seen, moved = now, time.monotonic()
        elif time.monotonic() - moved > STALL_S:
            pytest.fail(f"no cell moved for {STALL_S} s (prompts {seen}); server log:\n{lab['log'].read_text()[-3000:]}")
        if _first_prompt(page) in ("[ ]:", "") and idle.count():
            reset_since = reset_since or time.monotonic()
            if time.monotonic() - reset_since > 10 and reruns < 2:
                _dismiss_dialogs(page)
                _run_all(page)
                reset_since, reruns = None, reruns + 1
        else:
            reset_since = None
        time.sleep(0.5)
    pytest.fail(f"the dashboard did not appear within {RUN_TIMEOUT_S} s; server log:\n{lab['log'].read_text()[-3000:]}")


def _wait_until(predicate, timeout_s: float, message: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    pytest.fail(message)


def _click(page, locator) -> None:
    """Click, after closing any dialog JupyterLab raised meanwhile. A late "Select Kernel" (JupyterLab giving up on
    the kernel it swapped out at start, while the notebook runs on the new one) would swallow the click; Escape
    closes it without choosing anything, so the notebook keeps its running kernel."""
    dialog = page.locator(".jp-Dialog")
    deadline = time.monotonic() + 60
    while True:
        for _ in range(10):
            if not (dialog.count() and dialog.first.is_visible()):
                break
            page.keyboard.press("Escape")
            time.sleep(0.5)
        try:  # a dialog raised between the check and the click intercepts it: close it and click again
            locator.click(timeout=5_000)
            return
        except Exception as exc:  # playwright's TimeoutError
            if "Timeout" not in type(exc).__name__ or time.monotonic() > deadline:
                raise


def _start_pause_stop(page, dash) -> None:
    """Start a long background run from the dashboard, see its progress line move, Pause (the line stops), Stop."""
    progress = dash.locator(".asyncrl-progress")

    def step(state: str):
        match = re.search(rf"^{state} \| step (\d+) of", progress.inner_text().strip())
        return int(match.group(1)) if match else None

    steps = dash.locator(".asyncrl-run-steps input")
    _click(page, steps)
    steps.fill("100000")
    steps.press("Tab")  # the widget takes the new value on change (blur)
    # ipywidgets holds a model's update back while an earlier message of that model awaits the kernel, but sends
    # another model's (Start's click) at once: under load Start ran the old 10 steps. Let the kernel take the value.
    idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")
    for _ in range(2):  # the held update goes out at the first idle, and keeps the kernel busy for a moment
        _wait_until(lambda: idle.count() > 0, 60, "the kernel did not go idle after the steps field changed")
        time.sleep(0.5)
    _click(page, dash.locator(".asyncrl-start"))
    report = dash.locator(".asyncrl-report")
    _wait_until(lambda: "started: 100000 steps" in report.inner_text(), 60,
                f"Start did not start 100000 steps: {report.inner_text()!r}")
    first = _wait_until(lambda: step("running"), 60, f"no running progress line: {progress.inner_text()!r}")
    _wait_until(lambda: (step("running") or 0) > first, 60, f"the progress line did not move from step {first}")
    _click(page, dash.locator(".asyncrl-pause"))
    paused = _wait_until(lambda: step("paused"), 30, f"the progress line does not say paused: {progress.inner_text()!r}")
    assert dash.locator(".asyncrl-pause").inner_text().strip() == "Resume"
    time.sleep(1.5)
    assert step("paused") == paused, "the run went on while paused"
    _click(page, dash.locator(".asyncrl-stop"))
    _wait_until(lambda: step("stopped") is not None, 30, f"no stopped progress line: {progress.inner_text()!r}")
    assert dash.locator(".asyncrl-start").is_enabled() and not dash.locator(".asyncrl-stop").is_enabled()


def test_dashboard_train_tick_then_start_pause_stop(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = None
        try:
            # On some machines JupyterLab replaces the kernel just after start and the queued cells never run: a
            # second try in a fresh page. A notebook that does not run in two tries fails the test (with the page
            # and the server log kept below): a user opening it would see the same.
            for attempt in range(2):
                if page is not None:
                    page.close()
                page = browser.new_page(viewport={"width": 1280, "height": 1400})
                page.set_default_timeout(60_000)
                try:
                    _open_notebook(page, lab)
                    if page.locator("#jp-left-stack").is_visible():  # more room for the notebook
                        _command(page, "application:toggle-left-area")
                    _run_all(page)
                    _wait_for_dashboard(page, lab)
                    break
                except pytest.fail.Exception as exc:
                    if "a notebook cell raised" in str(exc) or attempt == 1:
                        raise
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
            _dismiss_dialogs(page)

            dash = page.locator(".asyncrl-dashboard")
            image = dash.locator(".asyncrl-buffer img")
            table = dash.locator(".asyncrl-verdict-table")
            report = dash.locator(".asyncrl-report")
            def views():
                return image.get_attribute("src"), table.inner_text(), report.inner_text()

            before = views()
            _click(page, dash.locator(".asyncrl-train-tick"))

            def changed():
                now = views()
                return now if now[0] != before[0] and now[1] != before[1] else None

            _, _, text = _wait_until(changed, 60, "the buffer view and the verdict table did not both change")
            assert text.startswith("train T=") and "selected 8" in text and "step finished" in text, text

            screenshot = os.environ.get("ASYNCRL_SCREENSHOT")
            if screenshot:
                _save_screenshot(page, dash, Path(screenshot))
            _start_pause_stop(page, dash)
        except BaseException:  # keep what is needed to see why, outside pytest's rotating temp dirs
            keep = Path(tempfile.gettempdir()) / "asyncrl-browser-test"
            keep.mkdir(exist_ok=True)
            shutil.copy(lab["log"], keep / "jupyterlab.log")
            if page is not None:
                page.screenshot(path=str(keep / "failure.png"), timeout=10_000)
            print(f"browser test failed: page and JupyterLab log in {keep}")
            raise
        finally:
            browser.close()


def _save_screenshot(page, dash, path: Path) -> None:
    """The dashboard and the markdown cell introducing it, at the top of a 1280-wide page, cut below the dashboard;
    a PNG under 500 KB."""
    cell = page.locator(".jp-Cell", has=page.locator(".asyncrl-dashboard"))
    intro = cell.locator("xpath=preceding-sibling::div[contains(@class, 'jp-Cell')][1]")
    (intro if intro.count() else cell).evaluate("el => el.scrollIntoView({block: 'start'})")
    page.mouse.move(0, 0)  # no hover highlight
    time.sleep(0.5)
    box = dash.bounding_box()
    height = min(1400, int(box["y"] + box["height"] + 24))
    path = path if path.is_absolute() else ROOT / path
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), clip={"x": 0, "y": 0, "width": 1280, "height": height})
    if path.stat().st_size > 500_000:
        from PIL import Image

        Image.open(path).convert("RGB").quantize(colors=256).save(path, optimize=True)
    assert path.stat().st_size < 500_000
