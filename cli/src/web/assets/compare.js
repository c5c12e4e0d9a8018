// Two sessions side by side from their fork point, as `agentlog compare A B` prints them:
// the page asks /v1/compare (the same comparison, as JSON) and lays it out per turn, each
// call beside the other side's call at the same place, the first difference marked.
"use strict";

const params = new URLSearchParams(location.search);
document.getElementById("a").value = params.get("a") || "";
document.getElementById("b").value = params.get("b") || "";

document.getElementById("pick").addEventListener("submit", (event) => {
  event.preventDefault();
  const a = document.getElementById("a").value.trim();
  const b = document.getElementById("b").value.trim();
  location.search = `?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`;
});

function sessionLink(id) {
  return el("a", { href: `/sessions/${encodeURIComponent(id)}` }, id);
}

function callCell(call, diverged) {
  if (!call) return el("td", { class: `call none${diverged ? " diverged" : ""}` }, "(no call)");
  const input = call.tool === "bash" && typeof call.input.command === "string"
    ? call.input.command : JSON.stringify(call.input);
  return el("td", { class: `call${diverged ? " diverged" : ""}`, "data-how": call.how },
    el("span", { class: `how ${call.how}` }, call.how.replace("_", " ")), " ",
    el("span", { class: "tool-name" }, call.tool), " ", el("code", {}, input),
    call.isError ? el("span", { class: "error" }, " (error)") : null);
}

function turnCell(turn) {
  if (!turn) return el("td", { class: "muted" }, "(no such turn)");
  return el("td", { class: "turn-side" },
    el("div", { class: "muted" }, `${(turn.models || []).join(", ") || "-"} · tokens ${turn.tokensIn || 0} in, ${turn.tokensOut || 0} out · ${(Number(turn.timeMs || 0) / 1000).toFixed(1)} s`),
    turn.error ? el("div", { class: "error" }, turn.error) : el("div", { class: "answer" }, turn.answer || ""));
}

function totalsCell(t) {
  return el("td", { class: "totals" },
    `${(t.models || []).join(", ") || "-"}: ${t.turns} turns, ${t.calls} calls (${t.served} served, ${t.ran} ran), tokens ${t.tokensIn} in, ${t.tokensOut} out, ${(Number(t.timeMs) / 1000).toFixed(1)} s`,
    el("div", { class: "answer" }, t.answer || ""));
}

function render(c) {
  document.getElementById("head-a").replaceChildren("A ", sessionLink(c.a));
  document.getElementById("head-b").replaceChildren("B ", sessionLink(c.b));
  const rows = [];
  for (const turn of c.turns) {
    rows.push(el("tr", { class: "turn-head", "data-turn": turn.number },
      el("th", { colspan: 3 }, `turn ${turn.number}`, turn.user ? el("span", { class: "user" }, ` you> ${turn.user}`) : null)));
    turn.calls.forEach((pair, i) => {
      const diverged = c.diverged && c.diverged.turn === turn.number && c.diverged.call === i + 1;
      rows.push(el("tr", { class: `call-row${pair.same ? "" : " differs"}`, "data-turn": turn.number, "data-call": i + 1 },
        el("td", { class: "muted" }, String(i + 1)), callCell(pair.a, diverged), callCell(pair.b, diverged)));
    });
    rows.push(el("tr", { class: "turn-foot" }, el("td", {}), turnCell(turn.a), turnCell(turn.b)));
  }
  document.getElementById("turns").replaceChildren(...rows);
  document.getElementById("totals").replaceChildren(
    el("tr", {}, el("th", {}, "total"), totalsCell(c.totalsA), totalsCell(c.totalsB)));
  document.getElementById("diverged").textContent = c.diverged
    ? `diverged at turn ${c.diverged.turn}, call ${c.diverged.call}: ${c.diverged.why}`
    : "the same calls on both sides";
  document.getElementById("comparison").hidden = false;
}

async function load() {
  const a = params.get("a");
  const b = params.get("b");
  if (!a || !b) return;
  document.title = `agentlog — ${a} vs ${b}`;
  try {
    render(await api("GET", `/v1/compare?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`));
  } catch (e) {
    const error = document.getElementById("error");
    error.textContent = e.message;
    error.hidden = false;
  }
}

load();
