//! `agentlog search QUERY`: SearchSessions, page after page up to `--limit`, one hit a line
//! (`--json`: each hit in the proto3 JSON mapping).

use std::io::Write;

use agentlog_proto::v1::SearchSessionsRequest;
use anyhow::Result;

use crate::commands::{ago, now_ms, Output};
use crate::render::hit_json;
use crate::store;

pub async fn search(out: &Output, query: &str, limit: usize) -> Result<()> {
    let mut client = store::connect(&out.addr).await?;
    let stdout = std::io::stdout();
    let mut stdout = stdout.lock();
    let mut shown = 0;
    let mut page_token = String::new();
    let now = now_ms();
    while shown < limit {
        let page = client
            .search_sessions(SearchSessionsRequest {
                query: query.to_string(),
                page_size: (limit - shown).min(100) as u32,
                page_token,
            })
            .await
            .map_err(|s| store::explain(&out.addr, "SearchSessions", s))?
            .into_inner();
        for hit in page.hits.iter().take(limit - shown) {
            if out.json {
                writeln!(stdout, "{}", hit_json(hit))?;
            } else {
                writeln!(
                    stdout,
                    "{}  #{}  {}  {}  {}",
                    hit.session_id,
                    hit.seq,
                    hit.kind,
                    ago(now - hit.ts_unix_ms),
                    hit.snippet
                )?;
            }
            shown += 1;
        }
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    if shown == 0 && !out.json {
        writeln!(stdout, "nothing found for {query:?}")?;
    }
    Ok(())
}
