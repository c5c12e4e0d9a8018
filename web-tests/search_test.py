"""The search box of `agentlog web` in a real browser (Debian's Chromium driven by Python's
playwright, launched as `browser_test.py` launches it, whose helpers it uses). Starts the
real event store and `agentlog web` from the cargo target dir, writes sessions over gRPC,
and checks what a person sees:

1. words typed in the search box list the hits, newest first, the words marked in each
   snippet; a hit deep in a long session opens that session at that event (the page
   scrolled to it and marked it);
2. a query with an unclosed quote says so on the page;
3. a session deleted from the API is no longer found.

A screenshot of the hits goes to screenshots/search.png.

Run: `cargo build --workspace --bins`, then `python3 web-tests/search_test.py`.
"""

import os
import re
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parent))
import browser_test as bt  # noqa: E402 (its helpers: the binaries, grpcurl, the children)


def append(addr, session, text):
    bt.grpcurl(addr, "Append", {"session_id": session, "events": [{"user_message": {"text": text}}]})


def main(pw):
    bt.SHOTS.mkdir(parents=True, exist_ok=True)
    store = bt.Child("event-store", ["--listen", "127.0.0.1:0", "--data-dir", str(bt.WORK / "data")])
    store_addr = store.listening()
    web = bt.Child("agentlog", ["--addr", store_addr, "web", "--listen", "127.0.0.1:0"])
    web_addr = web.listening()

    def url(path):
        return f"http://{web_addr}{path}"

    # A long session whose 40th event holds the words, and a newer short one.
    for i in range(1, 61):
        text = "the flaky test was fixed by pinning the clock" if i == 40 else f"filler message number {i}"
        append(store_addr, "long-session", text)
    append(store_addr, "short-session", "another flaky run on Tuesday")

    profile = tempfile.mkdtemp(prefix="agentlog-web-chromium-")
    browser = pw.chromium.launch_persistent_context(
        profile,
        executable_path=os.environ.get("CHROMIUM", "/usr/bin/chromium"),
        headless=True,
        viewport={"width": 1100, "height": 700},
        args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync"],
    )
    page_errors = []
    try:
        page = browser.pages[0] if browser.pages else browser.new_page()
        page.set_default_timeout(bt.PATIENCE_MS)
        page.on("pageerror", lambda e: page_errors.append(str(e)))

        # ---- 1. hits, newest first, marked; a hit opens its session at the event ----
        page.goto(url("/"))
        # The index takes its moment: search again until both hits are in.
        for _ in range(100):
            page.fill("#search-q", "FLAKY")
            page.click("#search button[type=submit]")
            page.wait_for_timeout(200)
            if page.locator("#hits li").count() == 2:
                break
        hits = page.locator("#hits li")
        assert hits.count() == 2, f"{hits.count()} hits"
        assert hits.nth(0).get_attribute("data-hit") == "short-session/1"
        assert hits.nth(1).get_attribute("data-hit") == "long-session/40"
        assert hits.nth(1).locator("mark").first.inner_text().lower() == "flaky"
        assert "pinning the clock" in hits.nth(1).inner_text()
        page.screenshot(path=str(bt.SHOTS / "search.png"), full_page=True)

        hits.nth(1).locator("a").click()
        page.wait_for_url(re.compile(r"/sessions/long-session#seq-40$"))
        found = page.locator('[data-seq="40"].found')
        found.wait_for()
        assert "pinning the clock" in found.inner_text()
        box = found.bounding_box()
        assert box is not None and 0 <= box["y"] <= 700, f"the event is not in view: {box}"

        # ---- 2. a bad query says what is wrong ----
        page.goto(url("/"))
        page.fill("#search-q", '"flaky test')
        page.click("#search button[type=submit]")
        error = page.locator("#search-error")
        error.wait_for(state="visible")
        assert "not closed" in error.inner_text(), error.inner_text()

        # ---- 3. a deleted session is no longer found ----
        request = urllib.request.Request(
            url("/v1/sessions/short-session"), method="DELETE",
            headers={"X-Agentlog-Request": "1"},
        )
        with urllib.request.urlopen(request) as response:
            assert response.status in (200, 204), response.status
        page.fill("#search-q", "flaky")
        page.click("#search button[type=submit]")
        page.wait_for_timeout(300)
        hits = page.locator("#hits li")
        assert [hits.nth(i).get_attribute("data-hit") for i in range(hits.count())] == ["long-session/40"]
        assert not page_errors, f"errors on the page: {page_errors}"
        print("search browser test: ok")
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
        print(f"search browser test FAILED: {e}", file=sys.stderr)
    finally:
        for child in bt.CHILDREN:
            child.kill9()
        shutil.rmtree(bt.WORK, ignore_errors=True)
    sys.exit(1 if failed else 0)
