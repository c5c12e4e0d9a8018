// The session list: refreshed every two seconds (the store has no list-wide event stream),
// filters kept in the address so a reload keeps them.
"use strict";

const POLL_MS = 2000;
const params = new URLSearchParams(location.search);
const query = document.getElementById("query");
const status = document.getElementById("status");
query.value = params.get("query") || "";
status.value = params.get("status") || "";

let timer = null;
let shown = []; // the sessions of the last refresh
// The pause of each waiting session, by "id@lastSeq" (null: it waits for an approval;
// undefined: not known yet). Looked up one at a time, once per seq.
const pauses = new Map();
let lookups = Promise.resolve();

function pauseOf(s) {
  const key = `${s.sessionId}@${s.lastSeq}`;
  if (!pauses.has(key)) {
    pauses.set(key, undefined);
    lookups = lookups
      .then(() => lastPause(s.sessionId, s.lastSeq))
      .then((pause) => {
        pauses.set(key, pause);
        render(shown);
      });
  }
  return pauses.get(key);
}

async function refresh() {
  clearTimeout(timer);
  const q = new URLSearchParams();
  if (query.value) q.set("query", query.value);
  if (status.value) q.set("status", status.value);
  history.replaceState(null, "", q.toString() ? `/?${q}` : "/");
  const conn = document.getElementById("conn");
  const error = document.getElementById("error");
  try {
    const page = await api("GET", `/v1/sessions?${q}`);
    render(page.sessions);
    conn.dataset.state = "live";
    conn.textContent = "live";
    error.hidden = true;
  } catch (e) {
    conn.dataset.state = "reconnecting";
    conn.textContent = "reconnecting";
    error.textContent = e.message;
    error.hidden = false;
  }
  timer = setTimeout(refresh, POLL_MS);
}

function render(sessions) {
  shown = sessions;
  const current = new Set(sessions.map((s) => `${s.sessionId}@${s.lastSeq}`));
  for (const [key, pause] of pauses) {
    if (pause !== undefined && !current.has(key)) pauses.delete(key);
  }
  const body = document.querySelector("#sessions tbody");
  body.replaceChildren(
    ...sessions.map((s) => {
      const href = `/sessions/${encodeURIComponent(s.sessionId)}`;
      const now = standing(s, statusName(s.status) === "waiting" ? pauseOf(s) : null);
      return el(
        "tr",
        { "data-session": s.sessionId },
        el("td", {}, el("span", { class: `badge ${now.name}` }, now.name),
          ...(s.pinned ? [" ", el("span", { class: "badge pinned", title: "Retention never deletes it" }, "pinned")] : [])),
        el("td", { class: "title" }, el("a", { href }, s.title || "(no message yet)"),
          ...(now.words.length ? [el("div", { class: "standing" }, ...now.words)] : [])),
        el("td", {}, el("a", { href, class: "id" }, s.sessionId)),
        el("td", { class: "num" }, s.lastSeq),
        el("td", { class: "muted" }, ago(s.updatedUnixMs)),
      );
    }),
  );
  document.getElementById("empty").hidden = sessions.length > 0;
}

document.getElementById("new").addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = document.getElementById("new-text").value;
  const id = newSessionId();
  try {
    await api("POST", `/v1/sessions/${id}/messages`, { text });
    location.href = `/sessions/${id}`;
  } catch (e) {
    const error = document.getElementById("error");
    error.textContent = e.message;
    error.hidden = false;
  }
});
query.addEventListener("input", refresh);
status.addEventListener("change", refresh);
refresh();
