// `agentlog web` in a real browser: Debian's Chromium driven by playwright-core (which
// downloads no browser of its own). Starts the real binaries from the cargo target dir —
// an event store, a runner with a scripted model that streams slowly, `agentlog web` — and
// checks what a person sees:
//
// 1. a session started from the list page fills in live as the reply streams;
//    `agentlog web` is SIGKILLed mid-stream and restarted on the same port, and the page
//    carries on by itself: every event shown once, in order, the streamed text never
//    doubled;
// 2. a call waiting for a person is approved from the page (the decision is in the log);
// 3. Cancel on the page appends an interrupt (it is in the log and in the transcript);
// 4. a re-run call and an interrupted turn are marked;
// 5. "Fork from here" on a settled point makes a fork and opens it ("forked from S at N").
// 6. Delete on the page, once confirmed, deletes the session: the page says so, the API
//    answers 404 SESSION_DELETED, and the list no longer shows it.
//
// Screenshots of the list and of session pages go to screenshots/.
//
// Run: `cargo build --workspace --bins`, then `node web-tests/browser.test.mjs`
// (CHROMIUM overrides /usr/bin/chromium; CARGO_TARGET_DIR is honoured; grpcurl on PATH).

import { spawn, execFileSync } from "node:child_process";
import { mkdtempSync, writeFileSync, mkdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import assert from "node:assert/strict";
import { chromium } from "playwright-core";

const here = dirname(fileURLToPath(import.meta.url));
const root = resolve(here, "..");
const bin = (name) => join(process.env.CARGO_TARGET_DIR || join(root, "target"), "debug", name);
const shots = join(here, "screenshots");
const PATIENCE_MS = 60_000; // bounds a wait for what must happen; never a claim about speed

const REPLY_0 =
  "I will look at the workspace first. Streaming this reply slowly on purpose, so that the " +
  "page shows it arriving piece by piece, and so that the web server can be killed and " +
  "restarted while it is still being written. Every piece must show up exactly once, in " +
  "order, whatever happens to the connection in between. Now, a command:";
const REPLY_1 = "The workspace is ready, and the greeting file says hello. All done.";

const work = mkdtempSync(join(tmpdir(), "agentlog-web-test-"));
const children = [];

function start(name, args, env = {}) {
  const child = spawn(bin(name), args, {
    env: { ...process.env, RUST_LOG: process.env.RUST_LOG || "info", ...env },
    stdio: ["ignore", "ignore", "pipe"],
  });
  children.push(child);
  const listening = new Promise((resolveAddr, reject) => {
    let pending = "";
    let found = false;
    child.stderr.on("data", (chunk) => {
      pending += chunk.toString();
      const lines = pending.split("\n");
      pending = lines.pop();
      for (const line of lines) {
        process.stderr.write(`[${name}] ${line}\n`);
        const m = line.match(/listen_addr="?([0-9.]+:[0-9]+)/);
        if (m && !found) {
          found = true;
          resolveAddr(m[1]);
        }
      }
    });
    child.on("exit", (code, signal) => reject(new Error(`${name} exited (${code ?? signal}) before listening`)));
  });
  listening.catch(() => {}); // only those awaited for their address must listen
  return { child, listening };
}

function kill9(child) {
  return new Promise((done) => {
    if (child.exitCode !== null || child.signalCode !== null) return done();
    child.once("exit", () => done());
    child.kill("SIGKILL");
  });
}

function grpcurl(addr, method, data) {
  const out = execFileSync("grpcurl", ["-plaintext", "-d", JSON.stringify(data), addr, `agentlog.v1.EventStore/${method}`]);
  return out.toString().trim();
}

// The whole log of a session, as the store has it.
function readLog(addr, session) {
  const out = grpcurl(addr, "Subscribe", { session_id: session, from_seq: 1, follow: false });
  return out ? out.split(/\n(?=\{)/).map((text) => JSON.parse(text)) : [];
}

async function main() {
  mkdirSync(shots, { recursive: true });
  const script = join(work, "script.jsonl");
  writeFileSync(
    script,
    [
      JSON.stringify({ text: REPLY_0, chunk_delay_ms: 60, tool_uses: [{ name: "bash", input: { command: "echo hello > greeting.txt && cat greeting.txt" } }] }),
      JSON.stringify({ text: REPLY_1, chunk_delay_ms: 20 }),
    ].join("\n") + "\n",
  );
  // Its listen address is in an INFO line.
  const store = start("event-store", ["--listen", "127.0.0.1:0", "--data-dir", join(work, "data")], { RUST_LOG: "info" });
  const storeAddr = await store.listening;
  const runner = start("runner", [
    "--event-store", `http://${storeAddr}`, "--runner-id", "browser-test-runner",
    "--workspace-root", join(work, "workspaces"), "--model", `scripted:${script}`,
  ]);
  let web = start("agentlog", ["--addr", storeAddr, "web", "--listen", "127.0.0.1:0"]);
  const webAddr = await web.listening;
  const url = (path) => `http://${webAddr}${path}`;

  const profile = mkdtempSync(join(tmpdir(), "agentlog-web-chromium-"));
  const browser = await chromium.launchPersistentContext(profile, {
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    viewport: { width: 1100, height: 900 },
    args: [
      "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync",
    ],
  });
  try {
    const page = browser.pages()[0] || (await browser.newPage());
    page.setDefaultTimeout(PATIENCE_MS);
    page.on("pageerror", (e) => { throw new Error(`page error: ${e.message}`); });

    // ---- 1. live, across a killed and restarted web server ----
    await page.goto(url("/"));
    await page.fill("#new-text", "Set up the workspace and greet me.");
    await page.click("#new button[type=submit]");
    await page.waitForURL(/\/sessions\/s-[0-9a-f]{12}$/);
    const session = decodeURIComponent(new URL(page.url()).pathname.split("/").pop());
    console.log(`session ${session}`);

    // The reply appears while it is generated: a growing prefix of the scripted text.
    const streamed = page.locator(".turn.agent.streaming .text");
    await page.waitForFunction(() => {
      const node = document.querySelector(".turn.agent.streaming .text");
      return node && node.textContent.length >= 40;
    });
    const early = await streamed.textContent();
    assert.ok(REPLY_0.startsWith(early), `streamed text is a prefix of the reply: ${JSON.stringify(early)}`);
    assert.ok(early.length < REPLY_0.length, "it was caught mid-stream");

    // SIGKILL the web server mid-stream; the page notices, then resumes by itself.
    await kill9(web.child);
    await page.waitForFunction(() => document.getElementById("conn").dataset.state === "reconnecting");
    await page.waitForTimeout(1500); // the stream goes on without a reader meanwhile
    web = start("agentlog", ["--addr", storeAddr, "web", "--listen", webAddr]);
    await web.listening;
    await page.waitForFunction(() => document.getElementById("conn").dataset.state === "live");

    // The turn finishes: the tool ran, the final reply arrived, the session is idle.
    await page.waitForSelector(".tool.done pre.result");
    await page.waitForFunction((text) => [...document.querySelectorAll(".turn.agent .text")].some((n) => n.textContent === text), REPLY_1);
    await page.waitForFunction(() => document.getElementById("status").textContent === "idle");
    const log = readLog(storeAddr, session);
    const lastSeq = Number(log[log.length - 1].seq);
    await page.waitForFunction((n) => window.agentlogSeen.length >= n, lastSeq);
    const seen = await page.evaluate(() => window.agentlogSeen);
    assert.deepEqual(seen, Array.from({ length: lastSeq }, (_, i) => i + 1), "every event once, in order");
    const replies = await page.locator(".turn.agent .text").allTextContents();
    assert.deepEqual(replies, [REPLY_0, REPLY_1], "each reply shown once, whole, never doubled");
    assert.equal(await page.locator(".turn.user .text").first().textContent(), "Set up the workspace and greet me.");
    assert.equal(await page.locator(".tool").count(), 1);
    assert.equal((await page.locator(".tool .input").textContent()).trim(), "echo hello > greeting.txt && cat greeting.txt");
    assert.equal((await page.locator(".tool pre.result").textContent()).includes("hello"), true);
    await page.screenshot({ path: join(shots, "session.png"), fullPage: true });

    // No runner from here on: what people decide is all that is written.
    await kill9(runner.child);

    // ---- 2. approve a pending call from the page ----
    const waiting = "approve-me";
    grpcurl(storeAddr, "Append", { session_id: waiting, events: [{ event_id: "u1", user_message: { text: "Delete the build cache." } }] });
    const lease = JSON.parse(grpcurl(storeAddr, "AcquireLease", { session_id: waiting, owner: "test-as-runner", ttl_ms: 60000 }));
    grpcurl(storeAddr, "Append", {
      session_id: waiting,
      lease_epoch: lease.epoch,
      events: [
        { event_id: "reply:1", assistant_message: { content: [{ text: { text: "I need to remove the cache directory." } }, { tool_use: { id: "toolu_0_0", name: "bash", input: { command: "rm -rf build/cache" } } }], stop_reason: "tool_use", model: "scripted" } },
        { event_id: "ask:toolu_0_0", approval_requested: { tool_use_id: "toolu_0_0", tool_name: "bash", input: { command: "rm -rf build/cache" }, reason: "bash needs a person's yes" } },
      ],
    });
    grpcurl(storeAddr, "ReleaseLease", { session_id: waiting, owner: "test-as-runner", epoch: lease.epoch });
    await page.goto(url(`/sessions/${waiting}`));
    await page.waitForFunction(() => document.getElementById("status").textContent === "waiting");
    await page.waitForSelector(".approval button.approve");
    await page.screenshot({ path: join(shots, "approval.png"), fullPage: true });
    await page.fill(".approval .note-input", "looks safe");
    await page.click(".approval button.approve");
    await page.waitForSelector(".decision.approved");
    assert.equal(await page.locator(".approval").count(), 0, "the buttons are gone once decided");
    const decided = readLog(storeAddr, waiting).filter((e) => e.approvalDecision);
    assert.equal(decided.length, 1);
    assert.deepEqual(decided[0].approvalDecision, { toolUseId: "toolu_0_0", approved: true, note: "looks safe" });

    // ---- 3. cancel from the page ----
    await page.click("#cancel");
    await page.waitForSelector(".turn.interrupt");
    const interrupts = readLog(storeAddr, waiting).filter((e) => e.interrupt);
    assert.equal(interrupts.length, 1, "the interrupt is in the log");
    assert.equal(interrupts[0].interrupt.reason, "cancelled from the web view");

    // ---- a re-run call and an interrupted turn are marked ----
    const rerun = "rerun-shown";
    grpcurl(storeAddr, "Append", { session_id: rerun, events: [{ event_id: "u1", user_message: { text: "Append a line." } }] });
    const lease2 = JSON.parse(grpcurl(storeAddr, "AcquireLease", { session_id: rerun, owner: "test-as-runner", ttl_ms: 60000 }));
    grpcurl(storeAddr, "Append", {
      session_id: rerun,
      lease_epoch: lease2.epoch,
      events: [
        { event_id: "reply:1", assistant_message: { content: [{ tool_use: { id: "toolu_0_0", name: "bash", input: { command: "echo line >> log.txt" } } }], stop_reason: "tool_use" } },
        { event_id: "started:1", tool_started: { tool_use_id: "toolu_0_0", idempotency_key: `${rerun}/toolu_0_0`, attempt: 1 } },
        { event_id: "started:2", tool_started: { tool_use_id: "toolu_0_0", idempotency_key: `${rerun}/toolu_0_0`, attempt: 2 } },
        { event_id: "result:toolu_0_0", tool_result: { tool_use_id: "toolu_0_0", content: "interrupted before it finished", is_error: true } },
        { event_id: "interrupted", interrupted: { reason: "the user cancelled" } },
      ],
    });
    await page.goto(url(`/sessions/${rerun}`));
    await page.waitForSelector(".note.interrupted");
    assert.match(await page.locator(".tool.rerun .rerun-note").textContent(), /attempt 2 with the same idempotency key rerun-shown\/toolu_0_0/);
    assert.equal(await page.locator(".tool.failed pre.result.is-error").count(), 1);
    assert.match(await page.locator(".note.interrupted").textContent(), /the user cancelled/);

    // ---- 5. fork from a settled point ----
    await page.goto(url(`/sessions/${session}`));
    await page.waitForFunction(() => document.getElementById("conn").dataset.state === "live");
    // The settled points of the first session: its user message, the call's result, the
    // final reply.
    await page.waitForFunction(() => document.querySelectorAll("button.fork").length === 3);
    const at = String(lastSeq);
    await page.click(`button.fork[data-fork-seq="${at}"]`);
    await page.waitForURL((u) => !u.pathname.endsWith(`/${session}`));
    const forked = decodeURIComponent(new URL(page.url()).pathname.split("/").pop());
    await page.waitForFunction(() => !document.getElementById("forked-from").hidden);
    assert.equal(await page.locator("#forked-from").textContent(), `forked from ${session} at ${at}`);
    await page.waitForFunction((text) => [...document.querySelectorAll(".turn.agent .text")].some((n) => n.textContent === text), REPLY_1);
    const forkLog = readLog(storeAddr, forked);
    assert.equal(forkLog.length, lastSeq, "the fork holds the parent's log up to the point");
    assert.deepEqual(forkLog.map((e) => e.eventId), log.map((e) => e.eventId));
    await page.screenshot({ path: join(shots, "fork.png"), fullPage: true });

    // ---- 6. delete from the page, after a confirmation ----
    await page.goto(url(`/sessions/${rerun}`));
    await page.waitForSelector(".note.interrupted");
    page.once("dialog", (dialog) => dialog.dismiss());
    await page.click("#delete");
    assert.equal((await fetch(url(`/v1/sessions/${rerun}`))).status, 200, "a dismissed confirmation deletes nothing");
    page.once("dialog", (dialog) => dialog.accept());
    await page.click("#delete");
    await page.waitForSelector("#deleted:not([hidden])");
    const gone = await fetch(url(`/v1/sessions/${rerun}`));
    assert.equal(gone.status, 404);
    assert.equal((await gone.json()).error.reason, "SESSION_DELETED");

    // ---- the list, live ----
    await page.goto(url("/"));
    await page.waitForSelector(`tr[data-session="${waiting}"]`);
    await page.waitForSelector(`tr[data-session="${session}"] .badge.idle`);
    assert.equal(await page.locator(`tr[data-session="${rerun}"]`).count(), 0, "a deleted session is not listed");
    await page.screenshot({ path: join(shots, "list.png"), fullPage: true });
    console.log("browser test: ok");
  } finally {
    await browser.close();
    rmSync(profile, { recursive: true, force: true });
  }
}

let failed = false;
try {
  await main();
} catch (e) {
  failed = true;
  console.error("browser test FAILED:", e);
} finally {
  for (const child of children) await kill9(child);
  rmSync(work, { recursive: true, force: true });
}
process.exit(failed ? 1 : 0);
