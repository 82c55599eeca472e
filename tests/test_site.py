"""The documentation site, read as a reader would: built by ``mkdocs build`` (what ``make docs``
runs) into a temporary folder, served on 127.0.0.1 and opened page by page in a real headless
Chromium (Debian's ``chromium``, which ``make setup`` installs), driven over the Chrome DevTools
protocol. Every page must load with no console error, no failed or remote request (the site loads
nothing from the network) and every image decoded; every internal link must reach a page that
exists, and an anchor in it that exists; the companion's first page must show Table 1 and the
paired Δτ figure; the maths must render (KaTeX, no error).

``python -m tests.test_site --screenshots docs/screenshots`` builds the site and writes the
screenshots of the two landing pages that are committed for review.
"""
from __future__ import annotations

import base64
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests import ROOT

CHROMIUM = next((p for p in (os.environ.get("CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser")) if p), None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars",
         "--window-size=1280,900", "--remote-debugging-port=0", "--remote-allow-origins=*"]
#: the two landing pages: the library's and the companion's
LANDING = {"library": "", "companion": "companion/"}


def build_site(dest: Path) -> Path:
    """``mkdocs build`` into ``dest`` (the same configuration as ``make docs``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    (ROOT / "build" / "site_src").mkdir(parents=True, exist_ok=True)   # mkdocs checks docs_dir before the hook fills it
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(dest)],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, f"mkdocs build failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return dest


class Server:
    """The built site on 127.0.0.1 (a random free port), served from a thread."""

    def __init__(self, root: Path):
        handler = functools.partial(_QuietHandler, directory=str(root))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.origin = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


class Browser:
    """A headless Chromium with a fresh profile and ``tabs`` tabs, spoken to over the DevTools protocol."""

    def __init__(self, executable: str, tabs: int = 1):
        import websocket  # websocket-client, pinned in requirements-docs.txt

        self.profile = tempfile.mkdtemp(prefix="hideseek-chromium-")
        self.proc = subprocess.Popen([executable, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().count("\n") >= 1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start ({executable}, exit {self.proc.poll()})")
            time.sleep(0.1)
        port, path = port_file.read_text().splitlines()[:2]
        self.ws = websocket.create_connection(f"ws://127.0.0.1:{port}{path}", timeout=60,
                                              suppress_origin=True)
        self._id = 0
        #: each tab's (DevTools session's) events since its last navigation
        self.events: dict[str, list[dict]] = {}
        #: each tab's state while it loads a page: [url, deadline, loaded, time of its last event]
        self._loading: dict[str, list] = {}
        self.sessions = []
        for _ in range(tabs):
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self.sessions.append(self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"])
            self.events[self.sessions[-1]] = []
            for domain in ("Page", "Runtime", "Log", "Network"):
                self.call(f"{domain}.enable", session=self.sessions[-1])
        self.session = self.sessions[0]

    def _route(self, event: dict) -> None:
        """File an event under its tab (browser-level events, which name no tab, are not kept)."""
        session = event.get("sessionId")
        if session in self.events:
            self.events[session].append(event)
            if session in self._loading:
                state = self._loading[session]
                state[3] = time.monotonic()
                state[2] = state[2] or event.get("method") == "Page.loadEventFired"

    def call(self, method: str, session: str | bool | None = None, **params):
        """Send a command (to the tab ``session``, or to the first tab for ``True``) and return its
        result; the events that arrive meanwhile are filed under their tabs."""
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session if session is True else session
        self.ws.send(json.dumps(msg))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._route(reply)

    def _event(self, timeout: float) -> bool:
        """File the next event; ``False`` when none comes within ``timeout`` seconds."""
        import websocket

        self.ws.settimeout(max(timeout, 1e-3))
        try:
            event = json.loads(self.ws.recv())
        except websocket.WebSocketTimeoutException:   # nothing came
            return False
        finally:
            self.ws.settimeout(60)
        self._route(event)
        return True

    def visit(self, urls: list[str], done, settle: float = 0.4, timeout: float = 60) -> None:
        """Open ``urls``, one per tab at a time (the tabs load side by side). A page is done once
        its tab had the load event and then no event for ``settle`` seconds (each event handled
        as it arrives); ``done(url, session, events)`` is then called with that tab's events
        (the tab's page still open in it) before the tab goes on to the next URL."""
        todo = list(urls)[::-1]

        def start(session: str) -> None:
            url = todo.pop()
            self.events[session] = []
            self._loading[session] = [url, time.monotonic() + timeout, False, time.monotonic()]
            self.call("Page.navigate", session=session, url=url)

        for session in self.sessions:
            if todo:
                start(session)
        while self._loading:
            now = time.monotonic()
            waits = []
            for session, (url, deadline, loaded, last) in list(self._loading.items()):
                if not loaded and now > deadline:
                    raise TimeoutError(f"{url} did not finish loading in {timeout} s")
                if loaded and (now - last >= settle or now > deadline):
                    del self._loading[session]
                    done(url, session, self.events[session])
                    if todo:
                        start(session)
                    break   # the clock moved: look again
                waits.append(min(last + settle, deadline) - now if loaded else deadline - now)
            else:
                self._event(min(waits))

    def evaluate(self, expression: str, session: str | bool = True):
        res = self.call("Runtime.evaluate", session=session, expression=expression, returnByValue=True,
                        awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression[:60]}…: {res['exceptionDetails']}")
        return res["result"].get("value")

    def screenshot(self, path: Path, session: str | bool = True) -> None:
        data = self.call("Page.captureScreenshot", session=session, format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


def problems(events: list[dict], origin: str) -> list[str]:
    """Console errors, uncaught exceptions, failed or remote requests among a page's events."""
    out = []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            out.append(f"uncaught: {d.get('exception', {}).get('description') or d.get('text')}")
        elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console.error: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
        elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
            out.append(f"log: {p['entry']['text']} {p['entry'].get('url', '')}")
        elif m == "Network.requestWillBeSent":
            url = p["request"]["url"]
            if not url.startswith((origin, "data:", "blob:", "about:")):
                out.append(f"remote request: {url}")
        elif m == "Network.responseReceived" and p["response"]["status"] >= 400:
            out.append(f"HTTP {p['response']['status']}: {p['response']['url']}")
        elif m == "Network.loadingFailed" and not p.get("canceled"):
            out.append(f"failed: {p.get('errorText')} (request {p.get('requestId')})")
    return out


#: what each page reports about itself, read in the page after it loaded
PAGE_JS = r"""(() => {
  const imgs = [...document.images].map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0}));
  const links = [...document.querySelectorAll("a[href]")].map(a => a.href);
  const ids = [...document.querySelectorAll("[id]")].map(e => e.id)
      .concat([...document.querySelectorAll("a[name]")].map(e => e.name));
  return {title: document.title, imgs, links, ids,
          katex: document.querySelectorAll(".katex").length,
          katexErrors: [...document.querySelectorAll(".katex-error")].map(e => e.textContent).slice(0, 5),
          table1Rows: document.querySelectorAll("#table1 table tbody tr").length,
          answer: [...document.querySelectorAll("img")].filter(i => i.src.endsWith("paired_delta_tau.png")
                                                              && i.naturalWidth > 0).length};
})()"""


def pages(site: Path) -> list[str]:
    return sorted(p.relative_to(site).as_posix().removesuffix("index.html")
                  for p in site.rglob("*.html"))


def read_site(site: Path, executable: str, screenshots: Path | None = None, tabs: int = 4) -> dict:
    """Open every page of ``site``, ``tabs`` at a time (one when taking screenshots); return what
    each page reported and its problems."""
    server = Server(site)
    browser = Browser(executable, tabs=1 if screenshots is not None else tabs)
    rel_of = {server.origin + rel: rel for rel in pages(site)}
    report = {}

    def done(url: str, session: str, events: list[dict]) -> None:
        rel = rel_of[url]
        info = browser.evaluate(PAGE_JS, session)
        info["problems"] = problems(events, server.origin)
        report[rel] = info
        if screenshots is not None and rel in LANDING.values():
            name = next(k for k, v in LANDING.items() if v == rel)
            browser.screenshot(screenshots / f"{name}.png", session)

    try:
        browser.visit(list(rel_of), done)
        report = {rel: report[rel] for rel in rel_of.values()}   # in the pages' order
        report["_origin"] = server.origin
        return report
    finally:
        browser.close()
        server.close()


def broken_links(report: dict, origin: str) -> list[str]:
    """Internal links whose page is not in the site or whose anchor is not in that page."""
    ids = {rel: set(info["ids"]) for rel, info in report.items() if not rel.startswith("_")}
    bad = []
    for rel, info in report.items():
        if rel.startswith("_"):
            continue
        for link in sorted(set(info["links"])):
            if not link.startswith(origin):
                continue
            parsed = urllib.parse.urlsplit(link)
            target = urllib.parse.unquote(parsed.path).lstrip("/")
            target = target.removesuffix("index.html")
            if target in ids:
                if parsed.fragment and urllib.parse.unquote(parsed.fragment) not in ids[target]:
                    bad.append(f"{rel or '/'} -> {link} (no such anchor)")
                continue
            try:  # not a page: a file (an image, objects.inv, …) must be served
                with urllib.request.urlopen(urllib.parse.urlunsplit(parsed._replace(fragment=""))) as r:
                    ok = r.status == 200
            except urllib.error.HTTPError:
                ok = False
            if not ok:
                bad.append(f"{rel or '/'} -> {link}")
    return bad


@pytest.fixture(scope="module")
def site_report(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (make setup installs it: `make browser`, as root)")
    site = build_site(tmp_path_factory.mktemp("site") / "site")
    server = Server(site)   # kept up for the link check, which fetches non-page files
    try:
        report = read_site(site, CHROMIUM)
        report["_bad_links"] = broken_links(report, report["_origin"])
    finally:
        server.close()
    report["_pages"] = pages(site)
    return report


@pytest.mark.slow
def test_every_page_loads_without_errors_and_every_image_shows(site_report):
    bad = []
    for rel in site_report["_pages"]:
        info = site_report[rel]
        bad += [f"{rel or '/'}: {p}" for p in info["problems"]]
        bad += [f"{rel or '/'}: image not shown: {i['src']}" for i in info["imgs"] if not i["ok"]]
    assert len(site_report["_pages"]) >= 20
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_every_internal_link_resolves(site_report):
    n = sum(len(site_report[rel]["links"]) for rel in site_report["_pages"])
    assert n > 100
    assert not site_report["_bad_links"], "\n".join(site_report["_bad_links"])


@pytest.mark.slow
def test_the_companion_opens_on_table1_and_the_delta_tau_figure(site_report):
    first = site_report["companion/"]
    assert first["answer"] == 1, "the paired Δτ figure is not shown on the companion's first page"
    table1 = (ROOT / "reports" / "table1.md").read_text(encoding="utf-8")
    rows = sum(1 for line in table1.splitlines() if line.startswith("| ") and not line.startswith("| setting"))
    assert first["table1Rows"] >= rows > 0, (first["table1Rows"], rows)


@pytest.mark.slow
def test_every_figure_and_notebook_is_in_the_site_with_its_provenance(site_report):
    shown = {i["src"].split("/companion/figures/", 1)[-1] for rel in site_report["_pages"]
             for i in site_report[rel]["imgs"] if i["ok"] and "/companion/figures/" in i["src"]}
    figures = {p.relative_to(ROOT / "reports" / "figures").as_posix()
               for p in (ROOT / "reports" / "figures").rglob("*.png")}
    assert figures and figures <= shown, sorted(figures - shown)
    for nb in (ROOT / "reports" / "notebooks").glob("*.ipynb"):
        assert f"companion/notebooks/{nb.stem}/" in site_report["_pages"], nb.name
    for stage in {f.split("/")[0] for f in figures}:
        links = site_report[f"companion/figures/{stage}/"]["links"]
        assert any(f"/pipeline/#stage-{stage}" in l for l in links), stage
        assert any("/companion/notebooks/" in l and "#cell-" in l for l in links), stage
        assert any("/commits/#commit-" in l for l in links), stage


@pytest.mark.slow
def test_the_maths_renders(site_report):
    maths = site_report["maths/"]
    assert maths["katex"] > 200 and not maths["katexErrors"], maths["katexErrors"]


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--screenshots", type=Path, required=True)
    args = ap.parse_args()
    if CHROMIUM is None:
        raise SystemExit("chromium is not installed: `make browser` (as root)")
    args.screenshots.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        report = read_site(build_site(Path(tmp) / "site"), CHROMIUM, screenshots=args.screenshots)
    print("\n".join(f"{k}: {v['problems']}" for k, v in report.items() if not k.startswith("_") and v["problems"]))
