// Shared by the pages of `agentlog web`: the JSON API, safe DOM building (text is always
// set as text, never parsed as HTML), and small formatting helpers.
"use strict";

// Calls the API; resolves to the parsed JSON (or null), rejects with the server's message.
async function api(method, path, body) {
  const init = { method, headers: { "X-Agentlog-Request": "1" }, credentials: "same-origin" };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  if (response.status === 401 && !path.startsWith("/login")) {
    location.href = "/login";
  }
  const text = await response.text();
  const data = text ? JSON.parse(text) : null;
  if (!response.ok) {
    const message = data && data.error ? data.error.message : response.statusText;
    const err = new Error(message);
    err.status = response.status;
    err.reason = data && data.error ? data.error.reason : undefined;
    throw err;
  }
  return data;
}

// el("div", {class: "x", "data-seq": 3}, "text", child, …)
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const STATUS_NAMES = {
  SESSION_STATUS_RUNNABLE: "runnable",
  SESSION_STATUS_IDLE: "idle",
  SESSION_STATUS_WAITING: "waiting",
};

function statusName(status) {
  return STATUS_NAMES[status] || "unknown";
}

// Every kind of event the pages know, as the event stream names them (its `event:` field);
// `unknown` is a kind newer than the server.
const KINDS = [
  "user_message", "assistant_message", "tool_started", "tool_result", "assistant_delta",
  "run_error", "interrupt", "interrupted", "approval_requested", "approval_decision",
  "session_config", "model_retry", "run_paused", "unknown",
];

// A session's status as people read it: the store's, or in its place "parked" (runnable,
// but no runner takes it up before its next model call is due) or "paused" (waiting after
// a run_paused, `pause`, rather than for an approval); with the words that say until when,
// or why and how to go on.
function standing(info, pause) {
  const name = statusName(info.status);
  if (name === "runnable" && Number(info.notBeforeUnixMs || 0) > Date.now()) {
    return { name: "parked", words: ["parked: the next model call is due ", dueNode(info.notBeforeUnixMs)] };
  }
  if (name === "waiting" && pause) return { name: "paused", words: [`paused: ${pauseWords(pause)}`] };
  return { name, words: [] };
}

// The last event of a waiting session that is not streamed text, if it is a run_paused:
// read from the session's event stream (its last few events, up to `caught_up`), so the
// list needs nothing the API does not serve already. Resolves to the pause, or null.
function lastPause(sessionId, lastSeq) {
  return new Promise((resolve) => {
    const from = Math.max(1, Number(lastSeq) - 7);
    const source = new EventSource(`/v1/sessions/${encodeURIComponent(sessionId)}/events?from_seq=${from}`);
    let pause = null;
    const done = () => { source.close(); resolve(pause); };
    for (const kind of KINDS) {
      if (kind === "assistant_delta") continue;
      source.addEventListener(kind, (m) => {
        pause = kind === "run_paused" ? (JSON.parse(m.data).runPaused || {}) : null;
      });
    }
    source.addEventListener("caught_up", done);
    source.addEventListener("deleted", done);
    source.onerror = done;
  });
}

const RETRY_WHY = {
  circuit_open: "is left alone for now (its circuit is open after failing in a row)",
  overloaded: "is overloaded",
  rate_limited: "is rate limited",
  server_error: "had a server error",
  timeout: "did not answer",
  stalled: "went silent in the middle of its reply",
  cut: "cut its reply short",
  unreachable: "could not be reached",
};

// A model_retry in words, as `agentlog show` says it: which model failed, why, the
// attempt, and (a node that keeps itself current) when the next call is due.
function retryWords(r) {
  const attempt = r.attempt ? ` (attempt ${r.attempt})` : "";
  const message = r.message ? `: ${r.message}` : "";
  return [`${r.model} ${RETRY_WHY[r.reason] || r.reason}${attempt}${message}; the next call is due `,
    dueNode(r.retryAtUnixMs || 0)];
}

const PAUSE_WHY = { budget: "the run reached its budget", gave_up: "every model kept failing" };

// A run_paused in words, and how to go on from this page.
function pauseWords(p) {
  const detail = p.detail ? ` (${p.detail})` : "";
  return `${PAUSE_WHY[p.reason] || p.reason}${detail}; the session waits for you: send a message to start a new run`;
}

// The model part of a PROVIDER:MODEL spec.
function modelName(spec) {
  const colon = spec.indexOf(":");
  return colon < 0 ? spec : spec.slice(colon + 1);
}

// Whether a reply naming `replyModel` came from `spec` (PROVIDER:MODEL): a reply names the
// model as its provider reported it, the name asked for or a version of it
// (claude-sonnet-4-5 answers as claude-sonnet-4-5-20250929, …-latest as a dated name).
function answeredBy(replyModel, spec) {
  const name = modelName(spec);
  if (replyModel === spec || replyModel === name) return true;
  const base = name.endsWith("-latest") ? name.slice(0, -"-latest".length) : name;
  const versioned = replyModel.startsWith(base) && "-@:".includes(replyModel.charAt(base.length) || "x");
  return versioned || replyModel.endsWith(`/${name}`);
}

// A session_config's budget in words (a field left out, or 0, is the runner's limit).
function budgetWords(b) {
  const part = (n, what) => (Number(n || 0) === 0 ? `the runner's ${what}` : `${n} ${what}`);
  return `${part(b.maxModelCalls, "model calls")}, ${part(b.maxTokens, "tokens")}, ${part(b.maxSeconds, "seconds")}`;
}

// When `unixMs` is, from now, as `agentlog` says it: "now", "in 12m 3s (at 2025-06-01T14:05:03Z)".
function dueWords(unixMs) {
  let left = Math.ceil((Number(unixMs) - Date.now()) / 1000);
  if (!(left > 0)) return "now";
  const parts = [];
  for (const [unit, size] of [["d", 86400], ["h", 3600], ["m", 60], ["s", 1]]) {
    if (left >= size) {
      parts.push(`${Math.floor(left / size)}${unit}`);
      left %= size;
    }
  }
  const at = new Date(Number(unixMs)).toISOString().replace(/\.\d+Z$/, "Z");
  return `in ${parts.join(" ")} (at ${at})`;
}

// A due time whose words are redone every second while the page is open.
function dueNode(unixMs) {
  return el("span", { class: "due", "data-due": String(unixMs) }, dueWords(unixMs));
}

setInterval(() => {
  for (const node of document.querySelectorAll(".due[data-due]")) {
    node.textContent = dueWords(node.dataset.due);
  }
}, 1000);

function ago(unixMs) {
  const s = Math.max(0, Math.floor((Date.now() - Number(unixMs)) / 1000));
  if (s < 60) return `${s}s ago`;
  if (s < 3600) return `${Math.floor(s / 60)}m ago`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ago`;
  return `${Math.floor(s / 86400)}d ago`;
}

// A new session id: `s-` and 12 hex digits, as `agentlog send` makes them.
function newSessionId() {
  const bytes = new Uint8Array(6);
  crypto.getRandomValues(bytes);
  return "s-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}
