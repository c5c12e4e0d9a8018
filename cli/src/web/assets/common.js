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
