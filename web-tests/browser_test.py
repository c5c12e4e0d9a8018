"""`agentlog web` in a real browser: Debian's Chromium driven by Python's playwright (which
downloads no browser of its own here: it is given /usr/bin/chromium). Starts the real
binaries from the cargo target dir — an event store, a runner with a scripted model that
streams slowly, `agentlog web` — and checks what a person sees:

1. a session started from the list page fills in live as the reply streams;
   `agentlog web` is SIGKILLed mid-stream and restarted on the same port, and the page
   carries on by itself: every event shown once, in order, the streamed text never
   doubled;
2. a call waiting for a person is approved from the page (the decision is in the log);
3. Cancel on the page appends an interrupt (it is in the log and in the transcript);
4. a re-run call and an interrupted turn are marked;
5. "Fork from here" on a settled point makes a fork and opens it ("forked from S at N");
6. Delete on the page, once confirmed, deletes the session: the page says so, the API
   answers 404 SESSION_DELETED, and the list no longer shows it.

Screenshots of the list and of session pages go to screenshots/.

Run: `cargo build --workspace --bins`, then `python3 web-tests/browser_test.py`
(CHROMIUM overrides /usr/bin/chromium; CARGO_TARGET_DIR is honoured; grpcurl on PATH).
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
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urlparse

from playwright.sync_api import sync_playwright

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHOTS = HERE / "screenshots"
PATIENCE_MS = 60_000  # bounds a wait for what must happen; never a claim about speed

REPLY_0 = (
    "I will look at the workspace first. Streaming this reply slowly on purpose, so that the "
    "page shows it arriving piece by piece, and so that the web server can be killed and "
    "restarted while it is still being written. Every piece must show up exactly once, in "
    "order, whatever happens to the connection in between. Now, a command:"
)
REPLY_1 = "The workspace is ready, and the greeting file says hello. All done."

WORK = Path(tempfile.mkdtemp(prefix="agentlog-web-test-"))
CHILDREN = []


def binary(name):
    target = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    return str(target / "debug" / name)


class Child:
    """A binary of ours, its stderr echoed with a prefix; `listening()` waits for the
    address its INFO line announces."""

    def __init__(self, name, args, env=None):
        self.name = name
        full_env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info"), **(env or {})}
        self.proc = subprocess.Popen(
            [binary(name), *args], env=full_env,
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
        self._found.set()  # it exited: whoever waits learns it from addr

    def listening(self):
        if not self._found.wait(PATIENCE_MS / 1000) or self.addr is None:
            raise RuntimeError(f"{self.name} exited ({self.proc.poll()}) before listening")
        return self.addr

    def kill9(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def grpcurl(addr, method, data):
    out = subprocess.run(
        ["grpcurl", "-plaintext", "-d", json.dumps(data), addr, f"agentlog.v1.EventStore/{method}"],
        check=True, capture_output=True,
    )
    return out.stdout.decode().strip()


def read_log(addr, session):
    """The whole log of a session, as the store has it."""
    out = grpcurl(addr, "Subscribe", {"session_id": session, "from_seq": 1, "follow": False})
    return [json.loads(text) for text in re.split(r"\n(?=\{)", out)] if out else []


def http_get(url):
    """(status, parsed JSON body) of a GET."""
    try:
        with urllib.request.urlopen(url) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def wait_text(page, selector_js, text):
    page.wait_for_function(
        f"(text) => [...document.querySelectorAll({json.dumps(selector_js)})].some((n) => n.textContent === text)",
        arg=text,
    )


def main(pw):
    SHOTS.mkdir(parents=True, exist_ok=True)
    script = WORK / "script.jsonl"
    script.write_text(
        json.dumps({"text": REPLY_0, "chunk_delay_ms": 60,
                    "tool_uses": [{"name": "bash", "input": {"command": "echo hello > greeting.txt && cat greeting.txt"}}]})
        + "\n" + json.dumps({"text": REPLY_1, "chunk_delay_ms": 20}) + "\n"
    )
    # Its listen address is in an INFO line.
    store = Child("event-store", ["--listen", "127.0.0.1:0", "--data-dir", str(WORK / "data")], {"RUST_LOG": "info"})
    store_addr = store.listening()
    runner = Child("runner", [
        "--event-store", f"http://{store_addr}", "--runner-id", "browser-test-runner",
        "--workspace-root", str(WORK / "workspaces"), "--model", f"scripted:{script}",
    ])
    web = Child("agentlog", ["--addr", store_addr, "web", "--listen", "127.0.0.1:0"])
    web_addr = web.listening()

    def url(path):
        return f"http://{web_addr}{path}"

    profile = tempfile.mkdtemp(prefix="agentlog-web-chromium-")
    browser = pw.chromium.launch_persistent_context(
        profile,
        executable_path=os.environ.get("CHROMIUM", "/usr/bin/chromium"),
        headless=True,
        viewport={"width": 1100, "height": 900},
        args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync"],
    )
    page_errors = []
    try:
        page = browser.pages[0] if browser.pages else browser.new_page()
        page.set_default_timeout(PATIENCE_MS)
        page.on("pageerror", lambda e: page_errors.append(str(e)))

        # ---- 1. live, across a killed and restarted web server ----
        page.goto(url("/"))
        page.fill("#new-text", "Set up the workspace and greet me.")
        page.click("#new button[type=submit]")
        page.wait_for_url(re.compile(r"/sessions/s-[0-9a-f]{12}$"))
        session = unquote(urlparse(page.url).path.split("/")[-1])
        print(f"session {session}")

        # The reply appears while it is generated: a growing prefix of the scripted text.
        page.wait_for_function(
            "() => { const n = document.querySelector('.turn.agent.streaming .text');"
            " return n && n.textContent.length >= 40; }"
        )
        early = page.locator(".turn.agent.streaming .text").text_content()
        assert REPLY_0.startswith(early), f"streamed text is a prefix of the reply: {early!r}"
        assert len(early) < len(REPLY_0), "it was caught mid-stream"

        # SIGKILL the web server mid-stream; the page notices, then resumes by itself.
        web.kill9()
        page.wait_for_function("() => document.getElementById('conn').dataset.state === 'reconnecting'")
        page.wait_for_timeout(1500)  # the stream goes on without a reader meanwhile
        web = Child("agentlog", ["--addr", store_addr, "web", "--listen", web_addr])
        web.listening()
        page.wait_for_function("() => document.getElementById('conn').dataset.state === 'live'")

        # The turn finishes: the tool ran, the final reply arrived, the session is idle.
        page.wait_for_selector(".tool.done pre.result")
        wait_text(page, ".turn.agent .text", REPLY_1)
        page.wait_for_function("() => document.getElementById('status').textContent === 'idle'")
        log = read_log(store_addr, session)
        last_seq = int(log[-1]["seq"])
        page.wait_for_function("(n) => window.agentlogSeen.length >= n", arg=last_seq)
        seen = page.evaluate("() => window.agentlogSeen")
        assert seen == list(range(1, last_seq + 1)), f"every event once, in order: {seen}"
        replies = page.locator(".turn.agent .text").all_text_contents()
        assert replies == [REPLY_0, REPLY_1], f"each reply shown once, whole, never doubled: {replies}"
        assert page.locator(".turn.user .text").first.text_content() == "Set up the workspace and greet me."
        assert page.locator(".tool").count() == 1
        assert page.locator(".tool .input").text_content().strip() == "echo hello > greeting.txt && cat greeting.txt"
        assert "hello" in page.locator(".tool pre.result").text_content()
        page.screenshot(path=str(SHOTS / "session.png"), full_page=True)

        # No runner from here on: what people decide is all that is written.
        runner.kill9()

        # ---- 2. approve a pending call from the page ----
        waiting = "approve-me"
        grpcurl(store_addr, "Append", {"session_id": waiting, "events": [{"event_id": "u1", "user_message": {"text": "Delete the build cache."}}]})
        lease = json.loads(grpcurl(store_addr, "AcquireLease", {"session_id": waiting, "owner": "test-as-runner", "ttl_ms": 60000}))
        grpcurl(store_addr, "Append", {
            "session_id": waiting,
            "lease_epoch": lease["epoch"],
            "events": [
                {"event_id": "reply:1", "assistant_message": {
                    "content": [{"text": {"text": "I need to remove the cache directory."}},
                                {"tool_use": {"id": "toolu_0_0", "name": "bash", "input": {"command": "rm -rf build/cache"}}}],
                    "stop_reason": "tool_use", "model": "scripted"}},
                {"event_id": "ask:toolu_0_0", "approval_requested": {
                    "tool_use_id": "toolu_0_0", "tool_name": "bash", "input": {"command": "rm -rf build/cache"},
                    "reason": "bash needs a person's yes"}},
            ],
        })
        grpcurl(store_addr, "ReleaseLease", {"session_id": waiting, "owner": "test-as-runner", "epoch": lease["epoch"]})
        page.goto(url(f"/sessions/{waiting}"))
        page.wait_for_function("() => document.getElementById('status').textContent === 'waiting'")
        page.wait_for_selector(".approval button.approve")
        page.screenshot(path=str(SHOTS / "approval.png"), full_page=True)
        page.fill(".approval .note-input", "looks safe")
        page.click(".approval button.approve")
        page.wait_for_selector(".decision.approved")
        assert page.locator(".approval").count() == 0, "the buttons are gone once decided"
        decided = [e for e in read_log(store_addr, waiting) if "approvalDecision" in e]
        assert len(decided) == 1
        assert decided[0]["approvalDecision"] == {"toolUseId": "toolu_0_0", "approved": True, "note": "looks safe"}

        # ---- 3. cancel from the page ----
        page.click("#cancel")
        page.wait_for_selector(".turn.interrupt")
        interrupts = [e for e in read_log(store_addr, waiting) if "interrupt" in e]
        assert len(interrupts) == 1, "the interrupt is in the log"
        assert interrupts[0]["interrupt"]["reason"] == "cancelled from the web view"

        # ---- 4. a re-run call and an interrupted turn are marked ----
        rerun = "rerun-shown"
        grpcurl(store_addr, "Append", {"session_id": rerun, "events": [{"event_id": "u1", "user_message": {"text": "Append a line."}}]})
        lease2 = json.loads(grpcurl(store_addr, "AcquireLease", {"session_id": rerun, "owner": "test-as-runner", "ttl_ms": 60000}))
        grpcurl(store_addr, "Append", {
            "session_id": rerun,
            "lease_epoch": lease2["epoch"],
            "events": [
                {"event_id": "reply:1", "assistant_message": {
                    "content": [{"tool_use": {"id": "toolu_0_0", "name": "bash", "input": {"command": "echo line >> log.txt"}}}],
                    "stop_reason": "tool_use"}},
                {"event_id": "started:1", "tool_started": {"tool_use_id": "toolu_0_0", "idempotency_key": f"{rerun}/toolu_0_0", "attempt": 1}},
                {"event_id": "started:2", "tool_started": {"tool_use_id": "toolu_0_0", "idempotency_key": f"{rerun}/toolu_0_0", "attempt": 2}},
                {"event_id": "result:toolu_0_0", "tool_result": {"tool_use_id": "toolu_0_0", "content": "interrupted before it finished", "is_error": True}},
                {"event_id": "interrupted", "interrupted": {"reason": "the user cancelled"}},
            ],
        })
        page.goto(url(f"/sessions/{rerun}"))
        page.wait_for_selector(".note.interrupted")
        note = page.locator(".tool.rerun .rerun-note").text_content()
        assert re.search(r"attempt 2 with the same idempotency key rerun-shown/toolu_0_0", note), note
        assert page.locator(".tool.failed pre.result.is-error").count() == 1
        assert "the user cancelled" in page.locator(".note.interrupted").text_content()

        # ---- 5. fork from a settled point ----
        page.goto(url(f"/sessions/{session}"))
        page.wait_for_function("() => document.getElementById('conn').dataset.state === 'live'")
        # The settled points of the first session: its user message, the call's result, the
        # final reply.
        page.wait_for_function("() => document.querySelectorAll('button.fork').length === 3")
        at = str(last_seq)
        page.click(f'button.fork[data-fork-seq="{at}"]')
        page.wait_for_url(lambda u: not urlparse(u).path.endswith(f"/{session}"))
        forked = unquote(urlparse(page.url).path.split("/")[-1])
        page.wait_for_function("() => !document.getElementById('forked-from').hidden")
        assert page.locator("#forked-from").text_content() == f"forked from {session} at {at}"
        wait_text(page, ".turn.agent .text", REPLY_1)
        fork_log = read_log(store_addr, forked)
        assert len(fork_log) == last_seq, "the fork holds the parent's log up to the point"
        assert [e["eventId"] for e in fork_log] == [e["eventId"] for e in log]
        page.screenshot(path=str(SHOTS / "fork.png"), full_page=True)

        # ---- 6. delete from the page, after a confirmation ----
        page.goto(url(f"/sessions/{rerun}"))
        page.wait_for_selector(".note.interrupted")
        page.once("dialog", lambda dialog: dialog.dismiss())
        page.click("#delete")
        assert http_get(url(f"/v1/sessions/{rerun}"))[0] == 200, "a dismissed confirmation deletes nothing"
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#delete")
        page.wait_for_selector("#deleted:not([hidden])")
        status, body = http_get(url(f"/v1/sessions/{rerun}"))
        assert status == 404, status
        assert body["error"]["reason"] == "SESSION_DELETED", body

        # ---- the list, live ----
        page.goto(url("/"))
        page.wait_for_selector(f'tr[data-session="{waiting}"]')
        page.wait_for_selector(f'tr[data-session="{session}"] .badge.idle')
        assert page.locator(f'tr[data-session="{rerun}"]').count() == 0, "a deleted session is not listed"
        page.screenshot(path=str(SHOTS / "list.png"), full_page=True)
        assert not page_errors, f"errors on the page: {page_errors}"
        print("browser test: ok")
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
        print(f"browser test FAILED: {e}", file=sys.stderr)
    finally:
        for child in CHILDREN:
            child.kill9()
        shutil.rmtree(WORK, ignore_errors=True)
    sys.exit(1 if failed else 0)
