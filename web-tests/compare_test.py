"""The compare page of `agentlog web` in a real browser: Debian's Chromium driven by
Python's playwright (given /usr/bin/chromium; it downloads no browser). Starts the real
binaries from the cargo target dir — an event store, a runner with two scripted models,
`agentlog web` — records a session on the first model, replays it on the second with
`agentlog replay`, and checks what a person sees:

1. the replay's session page marks the served result ("served from the recording …") and
   names the model of each reply, and its "compare with it" link opens the compare page;
2. the compare page puts the two side by side: per turn each call beside the other side's,
   the served one marked `served`, the first difference marked, the models and the final
   answers of both.

A screenshot of the compare page goes to screenshots/compare.png.

Run: `cargo build --workspace --bins`, then `python3 web-tests/compare_test.py`
(CHROMIUM overrides /usr/bin/chromium; CARGO_TARGET_DIR is honoured).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHOTS = HERE / "screenshots"
PATIENCE_S = 60  # bounds a wait for what must happen; never a claim about speed

WORK = Path(tempfile.mkdtemp(prefix="agentlog-compare-test-"))
CHILDREN = []


def binary(name):
    target = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    return str(target / "debug" / name)


class Child:
    """A binary of ours, its stderr echoed with a prefix; `listening()` waits for the
    address its INFO line announces."""

    def __init__(self, name, args):
        self.name = name
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")}
        self.proc = subprocess.Popen(
            [binary(name), *args], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        self.addr = None
        self._found = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        CHILDREN.append(self)

    def _read(self):
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            sys.stderr.write(f"[{self.name}] {line}\n")
            m = re.search(r'listen_addr="?([0-9.]+:[0-9]+)', line)
            if m and not self._found.is_set():
                self.addr = m.group(1)
                self._found.set()
        self._found.set()

    def listening(self):
        if not self._found.wait(PATIENCE_S) or self.addr is None:
            raise RuntimeError(f"{self.name} exited ({self.proc.poll()}) before listening")
        return self.addr

    def kill9(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def agentlog(store_addr, *args):
    out = subprocess.run([binary("agentlog"), "--addr", store_addr, *args],
                         capture_output=True, stdin=subprocess.DEVNULL, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"agentlog {' '.join(args)}: {out.stderr.decode()}")
    return out.stdout.decode()


def wait_final(store_addr, session):
    """The session's log once it ends in a final reply."""
    deadline = time.monotonic() + PATIENCE_S
    while True:
        events = [json.loads(line) for line in agentlog(store_addr, "--json", "show", session).splitlines()]
        last = [e for e in events if "assistantDelta" not in e]
        if last and last[-1].get("assistantMessage", {}).get("stopReason") == "end_turn":
            return events
        if time.monotonic() > deadline:
            raise RuntimeError(f"{session} did not finish: {events}")
        time.sleep(0.1)


def script(path, replies):
    path.write_text("".join(json.dumps(reply) + "\n" for reply in replies))
    return f"scripted:{path}"


def main(pw):
    SHOTS.mkdir(parents=True, exist_ok=True)
    recorded = script(WORK / "recorded.jsonl", [
        {"text": "Writing the note.", "tool_uses": [{"name": "write_file", "input": {"path": "note.txt", "content": "hi\n"}}]},
        {"text": "Reading it back.", "tool_uses": [{"name": "read_file", "input": {"path": "note.txt"}}]},
        {"text": "The note says hi."},
    ])
    replayed = script(WORK / "replayed.jsonl", [
        {"text": "Same first step.", "tool_uses": [{"name": "write_file", "input": {"path": "note.txt", "content": "hi\n"}}]},
        {"text": "Listing instead.", "tool_uses": [{"name": "list_files", "input": {}}]},
        {"text": "There is one note."},
    ])
    store = Child("event-store", ["--listen", "127.0.0.1:0", "--data-dir", str(WORK / "data")])
    store_addr = store.listening()
    Child("runner", [
        "--event-store", f"http://{store_addr}", "--runner-id", "compare-test-runner",
        "--workspace-root", str(WORK / "workspaces"), "--model", recorded, "--model", replayed,
    ])
    web = Child("agentlog", ["--addr", store_addr, "web", "--listen", "127.0.0.1:0"])
    web_addr = web.listening()

    agentlog(store_addr, "send", "--session", "recorded-1", "write a note, then read it")
    wait_final(store_addr, "recorded-1")
    replay = agentlog(store_addr, "replay", "recorded-1", "--model", replayed).strip()
    events = wait_final(store_addr, replay)
    served = [e["toolResult"] for e in events if "servedFrom" in e.get("toolResult", {})]
    assert len(served) == 1, events

    profile = tempfile.mkdtemp(prefix="agentlog-compare-chromium-")
    browser = pw.chromium.launch_persistent_context(
        profile,
        executable_path=os.environ.get("CHROMIUM", "/usr/bin/chromium"),
        headless=True,
        viewport={"width": 1280, "height": 900},
        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--no-first-run"],
    )
    page_errors = []
    try:
        page = browser.pages[0] if browser.pages else browser.new_page()
        page.on("pageerror", lambda e: page_errors.append(str(e)))

        # ---- the replay's own page ----
        page.goto(f"http://{web_addr}/sessions/{replay}")
        page.wait_for_selector(".tool.served .served-note", timeout=PATIENCE_S * 1000)
        note = page.locator(".tool.served .served-note").first.text_content()
        assert "served from the recording recorded-1" in note, note
        models = page.locator(".reply-model").all_text_contents()
        assert models and all(m == f"reply by {replayed}" for m in models), models
        assert page.locator(".note.config").first.text_content().startswith("a replay of recorded-1")
        page.wait_for_selector("#compare-link", timeout=PATIENCE_S * 1000)
        page.click("#compare-link")

        # ---- the compare page ----
        page.wait_for_selector("#comparison:not([hidden])", timeout=PATIENCE_S * 1000)
        assert f"a=recorded-1&b={replay}" in page.url, page.url
        assert page.locator("#head-a").text_content() == "A recorded-1"
        assert page.locator("#head-b").text_content() == f"B {replay}"
        assert page.locator("tr.turn-head .user").first.text_content() == " you> write a note, then read it"
        rows = page.locator("tr.call-row")
        assert rows.count() == 2, rows.count()
        first_b = rows.nth(0).locator("td.call").nth(1)
        assert first_b.get_attribute("data-how") == "served"
        assert first_b.locator(".how").text_content() == "served"
        assert rows.nth(0).locator("td.call").nth(0).get_attribute("data-how") == "ran"
        second = rows.nth(1)
        assert "differs" in second.get_attribute("class")
        assert second.locator("td.call.diverged").count() == 2
        assert "read_file" in second.locator("td.call").nth(0).text_content()
        assert "list_files" in second.locator("td.call").nth(1).text_content()
        diverged = page.locator("#diverged").text_content()
        assert diverged.startswith("diverged at turn 1, call 2"), diverged
        totals = page.locator("#totals td.totals").all_text_contents()
        assert recorded in totals[0] and "The note says hi." in totals[0], totals
        assert replayed in totals[1] and "1 served, 1 ran" in totals[1], totals
        page.screenshot(path=str(SHOTS / "compare.png"), full_page=True)

        # A session that does not exist: the page says so.
        page.goto(f"http://{web_addr}/compare?a=recorded-1&b=nope")
        page.wait_for_selector("#error:not([hidden])", timeout=PATIENCE_S * 1000)
        assert "GetSession" in page.locator("#error").text_content()
        assert not page_errors, f"errors on the page: {page_errors}"
        print("compare page test: ok")
    finally:
        browser.close()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    failed = False
    try:
        with sync_playwright() as pw:
            main(pw)
    except Exception as e:  # noqa: BLE001 (reported, and the exit code says it)
        failed = True
        import traceback
        traceback.print_exc()
        print(f"compare page test FAILED: {e}", file=sys.stderr)
    finally:
        for child in CHILDREN:
            child.kill9()
        shutil.rmtree(WORK, ignore_errors=True)
    sys.exit(1 if failed else 0)
