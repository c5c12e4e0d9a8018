"""Work that keeps failing, as `agentlog web` shows it in a real browser (Debian's Chromium
driven by Python's playwright, launched as `browser_test.py` launches it, whose helpers it
uses). Starts the real event store and `agentlog web` from the cargo target dir, writes the
runner's events over gRPC under a lease (as a runner writes them), and checks what a person
reads:

1. the list says a parked session is parked and when its next model call is due, and a
   paused one that it is paused and why; a call waiting for an approval stays "waiting";
2. a parked session's page says each retry (model, why, attempt, when the next call is
   due) and that it is parked until then;
3. a paused session's page says its configuration (the fallbacks, the budget), which model
   a fallback reply stood in for, and the pause: why, the detail, and how to go on.

A screenshot of the paused session goes to screenshots/failing-work.png.

Run: `cargo build --workspace --bins`, then `python3 web-tests/failing_work_test.py`.
"""

import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parent))
import browser_test as bt  # noqa: E402 (its helpers: the binaries, grpcurl, the children)

HOUR_MS = 3_600_000


def as_runner(addr, session, events):
    """Appends runner-written events as a runner does: under a lease, let go after."""
    lease = json.loads(bt.grpcurl(addr, "AcquireLease", {"session_id": session, "owner": "test-as-runner", "ttl_ms": 60000}))
    bt.grpcurl(addr, "Append", {"session_id": session, "lease_epoch": lease["epoch"], "events": events})
    bt.grpcurl(addr, "ReleaseLease", {"session_id": session, "owner": "test-as-runner", "epoch": lease["epoch"]})


def retry(n, model, reason, message, at_ms):
    return {"event_id": f"retry:{n}", "model_retry": {
        "turn": 0, "attempt": n, "model": model, "reason": reason, "message": message,
        "retry_at_unix_ms": str(at_ms)}}


def write_sessions(addr):
    now = int(time.time() * 1000)
    # Parked: the model is rate limited for the next hour.
    bt.grpcurl(addr, "Append", {"session_id": "parked", "events": [
        {"event_id": "u1", "user_message": {"text": "Summarise the quarterly report."}}]})
    as_runner(addr, "parked", [retry(1, "anthropic:big", "rate_limited", "HTTP 429", now + HOUR_MS)])

    # Paused: two retries, a fallback answered, then the run reached its budget.
    bt.grpcurl(addr, "Append", {"session_id": "paused", "events": [
        {"event_id": "config", "session_config": {
            "model": "anthropic:big", "fallback_models": ["openai:small"],
            "budget": {"max_model_calls": "1"}}},
        {"event_id": "u1", "user_message": {"text": "Tidy the workspace."}}]})
    as_runner(addr, "paused", [
        retry(1, "anthropic:big", "overloaded", "HTTP 529", now),
        retry(2, "anthropic:big", "overloaded", "HTTP 529", now),
        {"event_id": "reply:1", "assistant_message": {
            "content": [{"text": {"text": "Listing it first."}},
                        {"tool_use": {"id": "toolu_1", "name": "bash", "input": {"command": "ls"}}}],
            "stop_reason": "tool_use", "model": "small-2025-01-01"}},
        {"event_id": "started:1", "tool_started": {"tool_use_id": "toolu_1", "idempotency_key": "paused/toolu_1", "attempt": 1}},
        {"event_id": "result:1", "tool_result": {"tool_use_id": "toolu_1", "content": "report.txt"}},
        {"event_id": "paused", "run_paused": {"reason": "budget", "detail": "max_model_calls 1 reached (1 replies)"}},
    ])

    # Waiting for a person's yes: not a pause.
    bt.grpcurl(addr, "Append", {"session_id": "asks", "events": [
        {"event_id": "u1", "user_message": {"text": "Clean up the build."}}]})
    as_runner(addr, "asks", [
        {"event_id": "reply:1", "assistant_message": {
            "content": [{"tool_use": {"id": "toolu_1", "name": "bash", "input": {"command": "rm -rf build"}}}],
            "stop_reason": "tool_use", "model": "anthropic:big"}},
        {"event_id": "ask:1", "approval_requested": {
            "tool_use_id": "toolu_1", "tool_name": "bash", "input": {"command": "rm -rf build"},
            "reason": "bash needs a person's yes"}},
    ])


def main(pw):
    bt.SHOTS.mkdir(parents=True, exist_ok=True)
    store = bt.Child("event-store", ["--listen", "127.0.0.1:0", "--data-dir", str(bt.WORK / "data")])
    store_addr = store.listening()
    web = bt.Child("agentlog", ["--addr", store_addr, "web", "--listen", "127.0.0.1:0"])
    web_addr = web.listening()
    write_sessions(store_addr)

    def url(path):
        return f"http://{web_addr}{path}"

    profile = tempfile.mkdtemp(prefix="agentlog-web-chromium-")
    browser = pw.chromium.launch_persistent_context(
        profile,
        executable_path=os.environ.get("CHROMIUM", "/usr/bin/chromium"),
        headless=True,
        viewport={"width": 1100, "height": 800},
        args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync"],
    )
    page_errors = []
    try:
        page = browser.pages[0] if browser.pages else browser.new_page()
        page.set_default_timeout(bt.PATIENCE_MS)
        page.on("pageerror", lambda e: page_errors.append(str(e)))

        # ---- 1. the list: parked (until when), paused (why), waiting ----
        page.goto(url("/"))
        page.wait_for_selector('tr[data-session="parked"] .badge.parked')
        due = page.locator('tr[data-session="parked"] .standing').inner_text()
        assert re.fullmatch(r"parked: the next model call is due in (59m \d+s|1h) \(at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\)", due), due
        page.wait_for_selector('tr[data-session="paused"] .badge.paused')
        why = page.locator('tr[data-session="paused"] .standing').inner_text()
        assert why == ("paused: the run reached its budget (max_model_calls 1 reached (1 replies)); "
                       "the session waits for you: send a message to start a new run"), why
        assert page.locator('tr[data-session="asks"] .badge').inner_text() == "waiting"
        assert page.locator('tr[data-session="asks"] .standing').count() == 0

        # ---- 2. a parked session: the retry, and when it is due ----
        page.goto(url("/sessions/parked"))
        page.wait_for_selector(".note.retry")
        note = page.locator(".note.retry").inner_text()
        assert re.fullmatch(r"anthropic:big is rate limited \(attempt 1\): HTTP 429; the next call is due in (59m \d+s|1h) \(at \S+Z\)", note), note
        page.wait_for_function("() => document.getElementById('status').textContent === 'parked'")
        assert page.locator("#standing").inner_text().startswith("parked: the next model call is due in ")

        # ---- 3. a paused session: configuration, retries, the fallback reply, the pause ----
        page.goto(url("/sessions/paused"))
        page.wait_for_selector(".note.paused")
        page.wait_for_function("() => document.getElementById('status').textContent === 'paused'")
        configs = page.locator(".note.config").all_inner_texts()
        assert configs == [
            "the session runs on anthropic:big from here on",
            "when its model keeps failing, a turn falls back to openai:small",
            "each run's budget: 1 model calls, the runner's tokens, the runner's seconds",
        ], configs
        retries = page.locator(".note.retry").all_inner_texts()
        assert retries == [
            "anthropic:big is overloaded (attempt 1): HTTP 529; the next call is due now",
            "anthropic:big is overloaded (attempt 2): HTTP 529; the next call is due now",
        ], retries
        by = page.locator(".reply-model").inner_text()
        assert by == "reply by small-2025-01-01, a fallback of anthropic:big", by
        paused = page.locator(".note.paused").inner_text()
        assert paused == ("paused: the run reached its budget (max_model_calls 1 reached (1 replies)); "
                          "the session waits for you: send a message to start a new run"), paused
        assert page.locator("#standing").inner_text() == paused
        # Every event was shown once, in order (the new kinds are followed like any other).
        page.wait_for_function("() => window.agentlogSeen.length === 8")
        assert page.evaluate("() => window.agentlogSeen") == list(range(1, 9))
        page.screenshot(path=str(bt.SHOTS / "failing-work.png"), full_page=True)

        # A message from the page starts a new run: the session is runnable again.
        page.fill("#text", "Go on, with a fresh budget.")
        page.click("#send button[type=submit]")
        page.wait_for_function("() => document.getElementById('status').textContent === 'runnable'")
        assert page.locator("#standing").is_hidden()
        assert not page_errors, f"errors on the page: {page_errors}"
        print("failing work test: ok")
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
        print(f"failing work test FAILED: {e}", file=sys.stderr)
    finally:
        for child in bt.CHILDREN:
            child.kill9()
        shutil.rmtree(bt.WORK, ignore_errors=True)
    sys.exit(1 if failed else 0)
