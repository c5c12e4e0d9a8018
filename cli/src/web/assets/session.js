// One session, live: the transcript as `agentlog show` prints it, built from the event
// stream of /v1/sessions/{id}/events.
//
// Promise: every event is rendered once, in seq order. `next` is the seq wanted next; an
// event below it is a repeat and skipped, one above it is a gap and answered by
// reconnecting from `next`. The connection is the page's own: on any error it reconnects
// from `next` with capped, jittered backoff, so a server restart or a sleeping laptop
// only delays the transcript. A deleted session (a `deleted` event, or a 404 whose reason
// is SESSION_DELETED) ends it: the page says so and stops reconnecting.
"use strict";

// The kinds a settled point (where a fork may be made) can end at.
const FORK_KINDS = new Set(["user_message", "assistant_message", "tool_result", "interrupted"]);
const BACKOFF_FIRST_MS = 250;
const BACKOFF_MAX_MS = 5000;

const sessionId = decodeURIComponent(location.pathname.replace(/^\/sessions\//, ""));
const base = `/v1/sessions/${encodeURIComponent(sessionId)}`;
const transcript = document.getElementById("transcript");
const conn = document.getElementById("conn");

let next = 1;
let source = null;
let backoff = BACKOFF_FIRST_MS;
let retryTimer = null;
let deleted = false;
// Every seq rendered, in order (the browser test reads it).
window.agentlogSeen = [];

document.getElementById("session-id").textContent = sessionId;
document.title = `agentlog — ${sessionId}`;

function setConn(state) {
  conn.dataset.state = state;
  conn.textContent = state;
}

function connect() {
  clearTimeout(retryTimer);
  if (source) source.close();
  setConn(next === 1 ? "connecting" : "reconnecting");
  source = new EventSource(`${base}/events?from_seq=${next}`);
  for (const kind of KINDS) source.addEventListener(kind, onEvent);
  source.addEventListener("deleted", showDeleted);
  source.addEventListener("caught_up", () => {
    backoff = BACKOFF_FIRST_MS;
    setConn("live");
    refreshInfo();
    refreshForkPoints();
    showFound();
  });
  source.onerror = () => reconnectLater();
}

// The session is gone for good: no more reconnects, no more sending.
function showDeleted() {
  deleted = true;
  clearTimeout(retryTimer);
  if (source) source.close();
  source = null;
  setConn("deleted");
  document.getElementById("deleted").hidden = false;
  for (const id of ["send", "delete"]) document.getElementById(id).hidden = true;
  for (const button of document.querySelectorAll("button.fork")) button.hidden = true;
}

async function reconnectLater() {
  if (source) source.close();
  source = null;
  // An error may be the session's deletion (its stream is then answered 404).
  await refreshInfo();
  if (deleted) return;
  setConn("reconnecting");
  const wait = backoff / 2 + Math.random() * backoff / 2;
  backoff = Math.min(backoff * 2, BACKOFF_MAX_MS);
  clearTimeout(retryTimer);
  retryTimer = setTimeout(connect, wait);
}

function onEvent(message) {
  const seq = Number(message.lastEventId);
  if (seq < next) return; // already shown
  if (seq > next) {
    // Never skip one: ask again from the first seq not shown.
    connect();
    return;
  }
  next = seq + 1;
  backoff = BACKOFF_FIRST_MS;
  window.agentlogSeen.push(seq);
  render(message.type, JSON.parse(message.data), seq);
  if (message.type !== "assistant_delta") refreshInfoSoon();
  if (FORK_KINDS.has(message.type)) refreshForkPointsSoon();
}

// ---- rendering -------------------------------------------------------------------------

let stream = null; // {turnId, node, text}: the reply being streamed
const tools = new Map(); // tool_use id -> its card
let sessionModel = null; // the model the latest session_config names
let fallbacks = []; // the fallbacks the latest session_config names
let turnModels = []; // the models the turn's model_retries name: the first is its head
let lastPaused = null; // the run_paused that is the last event but streamed text, if it is

function add(node) {
  const atBottom = window.innerHeight + window.scrollY >= document.body.scrollHeight - 40;
  transcript.append(node);
  if (atBottom) window.scrollTo(0, document.body.scrollHeight);
  return node;
}

function endStream() {
  if (stream) stream.node.classList.remove("streaming");
  stream = null;
}

function render(kind, ev, seq) {
  if (kind !== "assistant_delta") lastPaused = kind === "run_paused" ? ev.runPaused || {} : null;
  switch (kind) {
    case "user_message":
      endStream();
      turnModels = [];
      add(el("div", { class: "turn user", "data-seq": seq }, el("span", { class: "who" }, "you"), el("div", { class: "text" }, ev.userMessage.text || "")));
      break;
    case "assistant_delta":
      delta(ev.assistantDelta, seq);
      break;
    case "assistant_message":
      reply(ev.assistantMessage || {}, seq);
      break;
    case "tool_started": {
      endStream();
      const s = ev.toolStarted;
      const card = cardFor(s.toolUseId, seq);
      const attempt = Number(s.attempt || 1);
      card.state.textContent = "running";
      if (attempt > 1) {
        card.node.classList.add("rerun");
        card.node.append(el("div", { class: "note rerun-note", "data-seq": seq },
          `interrupted; running it again as attempt ${attempt} with the same idempotency key ${s.idempotencyKey}`));
      }
      break;
    }
    case "tool_result": {
      endStream();
      const r = ev.toolResult;
      const card = cardFor(r.toolUseId, seq);
      card.state.textContent = r.isError ? "error" : "done";
      card.node.classList.add(r.isError ? "failed" : "done");
      card.node.append(el("pre", { class: `result${r.isError ? " is-error" : ""}`, "data-seq": seq }, r.content || ""));
      if (r.servedFrom) {
        card.node.classList.add("served");
        card.state.textContent = "served";
        card.node.append(el("div", { class: "served-note" }, "served from the recording ",
          el("a", { href: `/sessions/${encodeURIComponent(r.servedFrom.sessionId)}` }, r.servedFrom.sessionId),
          ` (seq ${r.servedFrom.seq}); the tool did not run`));
      }
      break;
    }
    case "session_config": {
      endStream();
      const c = ev.sessionConfig || {};
      if (c.model) sessionModel = c.model;
      if ((c.fallbackModels || []).length) fallbacks = c.fallbackModels;
      const said = [];
      if (c.replay) {
        said.push(`a replay of ${c.replay.sessionId} after seq ${c.replay.afterSeq || 0} on ${c.model}; off the recorded path: ${c.replay.offPath === "OFF_PATH_STOP" ? "stop" : "run"}`);
      } else if (c.model) {
        said.push(`the session runs on ${c.model} from here on`);
      }
      if ((c.fallbackModels || []).length) said.push(`when its model keeps failing, a turn falls back to ${c.fallbackModels.join(", then ")}`);
      if (c.budget) said.push(`each run's budget: ${budgetWords(c.budget)}`);
      for (const text of said) add(el("div", { class: "note config", "data-seq": seq }, text));
      break;
    }
    case "model_retry": {
      endStream();
      const r = ev.modelRetry || {};
      turnModels.push(r.model);
      add(el("div", { class: "note retry", "data-seq": seq }, ...retryWords(r)));
      break;
    }
    case "run_paused":
      endStream();
      add(el("div", { class: "note paused", "data-seq": seq }, `paused: ${pauseWords(ev.runPaused || {})}`));
      break;
    case "run_error":
      endStream();
      add(el("div", { class: "turn error", "data-seq": seq }, el("span", { class: "who" }, "error"), el("div", { class: "text" }, ev.runError.message || "")));
      break;
    case "interrupt":
      endStream();
      add(el("div", { class: "turn user interrupt", "data-seq": seq }, el("span", { class: "who" }, "you"), el("div", { class: "text" }, `(interrupt) ${ev.interrupt.reason || ""}`)));
      break;
    case "interrupted":
      endStream();
      add(el("div", { class: "note interrupted", "data-seq": seq }, `interrupted: ${ev.interrupted.reason || ""}`));
      break;
    case "approval_requested":
      endStream();
      approvalRequested(ev.approvalRequested, seq);
      break;
    case "approval_decision": {
      endStream();
      const d = ev.approvalDecision;
      const card = cardFor(d.toolUseId, seq);
      if (card.approval) card.approval.remove();
      card.approval = null;
      const verdict = d.approved ? "approved" : "denied";
      card.node.append(el("div", { class: `decision ${verdict}`, "data-seq": seq }, d.note ? `${verdict}: ${d.note}` : verdict));
      break;
    }
    default:
      break; // a kind newer than this page: skipped, as readers must
  }
}

function delta(d, seq) {
  if (!stream || stream.turnId !== d.turnId) {
    if (stream && stream.text) {
      // The runner was replaced mid-reply; the turn streams again.
      stream.node.classList.remove("streaming");
      add(el("div", { class: "note restarted" }, "the reply was interrupted; it is streaming again"));
    }
    const text = el("div", { class: "text" });
    const node = add(el("div", { class: "turn agent streaming", "data-seq": seq }, el("span", { class: "who" }, "agent"), text));
    stream = { turnId: d.turnId, node, textNode: text, text: "" };
  }
  stream.text += d.text || "";
  stream.textNode.append(d.text || "");
}

function reply(m, seq) {
  const blocks = m.content || [];
  const text = blocks.filter((b) => b.text).map((b) => b.text.text || "").join("\n");
  if (stream) {
    // The record replaces what was streamed (they are the same unless a stream restarted).
    stream.textNode.textContent = text;
    stream.node.dataset.seq = seq;
    endStream();
  } else if (text) {
    add(el("div", { class: "turn agent", "data-seq": seq }, el("span", { class: "who" }, "agent"), el("div", { class: "text" }, text)));
  }
  const head = m.model ? stoodInFor(m.model) : null;
  turnModels = [];
  if (head) {
    add(el("div", { class: "reply-model fallback", "data-seq": seq }, `reply by ${m.model}, a fallback of ${head}`));
  } else if (m.model) {
    add(el("div", { class: "reply-model", "data-seq": seq }, `reply by ${m.model}`));
  }
  for (const block of blocks) {
    if (!block.toolUse) continue;
    const call = block.toolUse;
    const input = call.input || {};
    const shown = call.name === "bash" && typeof input.command === "string" ? input.command : JSON.stringify(input, null, 2);
    const card = cardFor(call.id, seq);
    card.name.textContent = call.name;
    card.input.textContent = shown;
  }
}

// The model a reply by `replyModel` stood in for, if a fallback answered, as `agentlog show`
// decides it: the turn's head (the session's model, else the one its first retry names),
// unless the reply is that model's; of the models known here, the one that answered is the
// one whose name fits the reply most closely.
function stoodInFor(replyModel) {
  const head = sessionModel || turnModels[0];
  if (!head) return null;
  let answered = null;
  for (const spec of [head, ...fallbacks, ...turnModels]) {
    if (answeredBy(replyModel, spec) && (!answered || modelName(spec).length > modelName(answered).length)) {
      answered = spec;
    }
  }
  return answered === head ? null : head;
}

// The card of one tool call, made on first mention.
function cardFor(id, seq) {
  let card = tools.get(id);
  if (card) return card;
  const name = el("span", { class: "tool-name" }, "tool");
  const state = el("span", { class: "tool-state" }, "");
  const input = el("pre", { class: "input" });
  const node = add(el("div", { class: "tool", "data-tool-use-id": id, "data-seq": seq },
    el("div", { class: "tool-head" }, "→ ", name, " ", el("code", { class: "muted" }, `[${id}]`), " ", state), input));
  card = { node, name, state, input, approval: null };
  tools.set(id, card);
  return card;
}

function approvalRequested(r, seq) {
  const card = cardFor(r.toolUseId, seq);
  card.name.textContent = r.toolName;
  if (!card.input.textContent) card.input.textContent = JSON.stringify(r.input || {}, null, 2);
  card.state.textContent = "waits for you";
  const note = el("input", { class: "note-input", placeholder: "note (optional)" });
  const error = el("span", { class: "error" });
  const decide = async (verb, buttons) => {
    buttons.forEach((b) => (b.disabled = true));
    error.textContent = "";
    try {
      await api("POST", `${base}/${verb}`, { toolUseId: r.toolUseId, note: note.value });
    } catch (e) {
      error.textContent = e.message;
      buttons.forEach((b) => (b.disabled = false));
    }
  };
  const approve = el("button", { class: "approve" }, "Approve");
  const deny = el("button", { class: "deny danger" }, "Deny");
  approve.addEventListener("click", () => decide("approve", [approve, deny]));
  deny.addEventListener("click", () => decide("deny", [approve, deny]));
  card.approval = el("div", { class: "approval", "data-seq": seq },
    el("div", {}, `A person must decide before this call runs: ${r.reason || ""}`),
    el("div", { class: "row" }, approve, deny, note), error);
  card.node.append(card.approval);
}

// ---- session info and actions ------------------------------------------------------------

let infoTimer = null;
let dueTimer = null;

function refreshInfoSoon() {
  if (!infoTimer) infoTimer = setTimeout(() => { infoTimer = null; refreshInfo(); }, 300);
}

async function refreshInfo() {
  try {
    const info = await api("GET", base);
    document.getElementById("title").textContent = info.title || "";
    const badge = document.getElementById("status");
    const now = standing(info, lastPaused);
    badge.textContent = now.name;
    badge.className = `badge ${now.name}`;
    const words = document.getElementById("standing");
    words.replaceChildren(...now.words);
    words.hidden = now.words.length === 0;
    // A parked session is taken up once it is due: look again then.
    clearTimeout(dueTimer);
    if (now.name === "parked") {
      dueTimer = setTimeout(refreshInfo, Number(info.notBeforeUnixMs) - Date.now() + 500);
    }
    document.getElementById("pinned").hidden = !info.pinned;
    refreshForkedFrom(info);
  } catch (e) {
    if (e.reason === "SESSION_DELETED") {
      showDeleted();
    } else if (e.status === 404) {
      document.getElementById("title").textContent = "(no events yet: send the first message)";
    }
  }
}

// "Fork from here" on each settled point: the server says which seqs those are (the
// store's rule, never a copy of it here).
let forkTimer = null;

function refreshForkPointsSoon() {
  if (!forkTimer) forkTimer = setTimeout(() => { forkTimer = null; refreshForkPoints(); }, 300);
}

async function refreshForkPoints() {
  let settled;
  try {
    settled = (await api("GET", `${base}/settled`)).settledSeqs || [];
  } catch (e) {
    return;
  }
  for (const seq of settled) {
    const node = transcript.querySelector(`[data-seq="${seq}"]`);
    if (!node || node.dataset.forkable) continue;
    node.dataset.forkable = "1";
    const button = el("button", { class: "fork", "data-fork-seq": seq, title: `A new session with this one's log up to seq ${seq}, and its workspace as it was then` }, "Fork from here");
    button.addEventListener("click", async () => {
      button.disabled = true;
      try {
        const made = await api("POST", `${base}/fork`, { atSeq: String(seq) });
        location.href = `/sessions/${encodeURIComponent(made.sessionId)}`;
      } catch (e) {
        showError(e.message);
        button.disabled = false;
      }
    });
    node.insertAdjacentElement("afterend", button);
  }
}

async function refreshForkedFrom(info) {
  const from = document.getElementById("forked-from");
  if (!info.forkedFrom) return;
  from.hidden = false;
  from.replaceChildren("forked from ",
    el("a", { href: `/sessions/${encodeURIComponent(info.forkedFrom.sessionId)}` }, info.forkedFrom.sessionId),
    ` at ${info.forkedFrom.seq}`);
  const compare = document.getElementById("compare-link");
  compare.href = `/compare?a=${encodeURIComponent(info.forkedFrom.sessionId)}&b=${encodeURIComponent(sessionId)}`;
  compare.hidden = false;
}

function showError(message) {
  const error = document.getElementById("error");
  error.textContent = message;
  error.hidden = !message;
}

document.getElementById("send").addEventListener("submit", async (event) => {
  event.preventDefault();
  const box = document.getElementById("text");
  try {
    await api("POST", `${base}/messages`, { text: box.value });
    box.value = "";
    showError("");
  } catch (e) {
    showError(e.message);
  }
});

document.getElementById("delete").addEventListener("click", async () => {
  if (!confirm(`Delete session ${sessionId} for good? Its events, title and workspace go, and it cannot be undone.`)) {
    return;
  }
  try {
    await api("DELETE", base);
    showDeleted();
  } catch (e) {
    showError(e.message);
  }
});

document.getElementById("cancel").addEventListener("click", async () => {
  try {
    await api("POST", `${base}/cancel`, { reason: "cancelled from the web view" });
    showError("");
  } catch (e) {
    showError(e.message);
  }
});

// Enter sends, Shift+Enter is a new line.
document.getElementById("text").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    document.getElementById("send").requestSubmit();
  }
});

// A search hit opens the session at its event (`#seq-N`): shown and marked once the
// history is in.
function showFound() {
  const found = /^#seq-(\d+)$/.exec(location.hash);
  const node = found && transcript.querySelector(`[data-seq="${found[1]}"]`);
  if (!node || node.classList.contains("found")) return;
  node.classList.add("found");
  node.scrollIntoView({ block: "center" });
}

connect();
