// The search box of the session list: GET /v1/search, newest first, a page at a time; each
// hit opens its session at that event (`/sessions/ID#seq-N`). The words of the query are
// marked in the snippets (set as text: nothing the store returns is parsed as HTML).
"use strict";

const searchForm = document.getElementById("search");
const searchBox = document.getElementById("search-q");
const results = document.getElementById("search-results");
const hitList = document.getElementById("hits");
const more = document.getElementById("search-more");
let nextToken = "";

// The query's words, lowercased, for marking (a prefix keeps its stem).
function queryWords(query) {
  return (query.toLowerCase().match(/[\p{L}\p{N}]+/gu) || []);
}

// The snippet as text nodes, the query's words inside <mark>.
function marked(snippet, words) {
  const span = el("span", { class: "snippet" });
  const parts = snippet.split(/([\p{L}\p{N}]+)/u);
  for (const part of parts) {
    const lower = part.toLowerCase();
    if (part && words.some((w) => lower.startsWith(w))) span.append(el("mark", {}, part));
    else if (part) span.append(document.createTextNode(part));
  }
  return span;
}

async function runSearch(append) {
  const query = searchBox.value;
  const error = document.getElementById("search-error");
  const params = new URLSearchParams({ q: query });
  if (append && nextToken) params.set("page_token", nextToken);
  results.hidden = false;
  try {
    const page = await api("GET", `/v1/search?${params}`);
    const words = queryWords(query);
    const items = page.hits.map((h) =>
      el("li", { "data-hit": `${h.sessionId}/${h.seq}` },
        el("a", { href: `/sessions/${encodeURIComponent(h.sessionId)}#seq-${h.seq}`, class: "hit" },
          el("span", { class: "hit-where" }, `${h.sessionId} · #${h.seq} · ${h.kind} · ${ago(h.tsUnixMs)}`),
          marked(h.snippet, words))));
    if (append) hitList.append(...items);
    else hitList.replaceChildren(...items);
    nextToken = page.nextPageToken || "";
    more.hidden = !nextToken;
    document.getElementById("search-empty").hidden = hitList.children.length > 0;
    error.hidden = true;
  } catch (e) {
    if (!append) hitList.replaceChildren();
    more.hidden = true;
    error.textContent = e.message;
    error.hidden = false;
  }
}

searchForm.addEventListener("submit", (event) => {
  event.preventDefault();
  runSearch(false);
});
more.addEventListener("click", () => runSearch(true));
