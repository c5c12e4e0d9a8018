//! The local backend's full-text index: `<data-dir>/search/`, a tantivy index derived from
//! the log, never its truth. tantivy because it is the full-text library made for this in
//! Rust and well kept (quickwit's, in production there): an inverted index with positions
//! (phrases), term-dictionary prefixes, deletes by term, merges that rewrite segments
//! without deleted documents, and commits that are atomic on disk (a `meta.json` written
//! and fsync'd last) carrying a payload of ours. Built without its stemmers and stop words;
//! its words are [`crate::search::text::words`], the same rule PostgreSQL's index and
//! every query's check use.
//!
//! **How it follows the log.** The indexer (a thread of its own) reads the log in order
//! ([`LogReader::scan`]) from the offset its last commit recorded, up to where the log is
//! durable (the writer says so after each fsync), and commits at most every
//! [`COMMIT_EVERY`], with the offset it has read up to as the commit's payload. So an event
//! is searchable at most about that long after its acknowledgement, plus the commit's own
//! time (which grows with the documents a commit holds and with the load the indexer's
//! lower priority yields to), and the index only ever holds what is durable (no phantom
//! after a crash: recovery keeps every durable record). The appends themselves never wait
//! for it.
//!
//! **After a crash** (`kill -9`, power loss) the index holds its last commit: everything
//! before its offset, nothing after. [`SearchIndex::open`] reads the log from that offset
//! to its end before the store serves, so nothing is missing; a record read twice is
//! indexed once (a commit covers whole appends, and the offset moves with it). An index
//! ahead of the log (a log restored from an older backup), unreadable, or of another
//! layout is rebuilt from the whole log. A catch-up that long ([`WIDE_CATCH_UP_BYTES`] or
//! more) runs on every core, since nothing is served meanwhile, and leaves its segments'
//! merges to the one-thread writer that follows the log once the store serves.
//!
//! **How it forgets a deleted session.** A search never shows a deleted session: every
//! candidate is checked against the session's state (a tombstone from the moment
//! `DeleteSession` returns) and read back from the log before it is shown. The words leave
//! the files when the indexer reaches the tombstone in the log: it deletes the session's
//! documents, commits, and then merges every segment holding deleted documents into one
//! without them (a merge writes only terms some live document still has) and removes the
//! old files. A crash before the delete's commit leaves the tombstone after the committed
//! offset: it is read again at open. A crash after it and before the merge's end leaves
//! segments with deleted documents: the indexer merges them at its next look, after a
//! restart too. So the words are gone within about a second of the tombstone reaching
//! the indexer, well within [`super::reclaim::ReclaimConfig::after`], and nothing brings
//! them back.
//!
//! A fork that shares its parent's prefix is indexed as its own: at its fork record the
//! indexer reads its seqs up to the fork point (through its base) and indexes them under
//! the fork's id. A prefix made the fork's own later ([`Record::Placed`]) replaces the
//! documents of those seqs.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentlog_proto::v1::{Event, SearchSessionsResponse};
use tantivy::directory::MmapDirectory;
use tantivy::indexer::{LogMergePolicy, NoMergePolicy, UserOperation};
use tantivy::query::{
    BooleanQuery, EnableScoring, Occur, PhraseQuery, Query, RangeQuery, RegexQuery, TermQuery,
};
use tantivy::schema::{
    Field, IndexRecordOption, Schema, TextFieldIndexing, TextOptions, Value, FAST, INDEXED, STORED,
    STRING,
};
use tantivy::tokenizer::{Token, TokenStream, Tokenizer};
use tantivy::{
    doc, DocAddress, Index, IndexReader, IndexWriter, ReloadPolicy, Searcher, TantivyDocument, Term,
};

use super::index::is_staging;
use super::log::{LogReader, Position, Record};
use super::signal::Signal;
use super::subscriptions::{position_of, read_up_to, Source};
use crate::backend::SearchOp;
use crate::error::StoreError;
use crate::scope::Scope;
use crate::search::{self, text, Clause};

/// The indexer commits at most this often by default: what an event waits, at most about,
/// before the commit that makes it found begins. Each commit writes a segment, syncs it and
/// feeds the merges, so a longer period costs less CPU an append, but not much: at 400 ms,
/// 3% less under a saturating load on two cores, where the worst freshness passed the
/// contract's 1 s (1.25 s; 0.7 s at this period). `agentlog-bench-search --commit-periods`
/// measures both (bench/RESULTS.md, "Search").
pub const COMMIT_EVERY: Duration = Duration::from_millis(200);
/// How much lower than the store's other threads the indexer and tantivy's threads run
/// (nice values): when appends take every core, they go first and the index falls behind,
/// to catch up as soon as the load leaves room. What gives way under a saturating load is
/// a search's freshness, never an acknowledgement; the index's CPU is still spent, later.
const NICE: i32 = 10;
/// How many segments of like size tantivy's merges join at once (its default is 8). Every
/// commit adds a small segment, and a document is rewritten once for each level of merges
/// it climbs: log base this of (documents ÷ a commit's), so fewer, wider merges cost less
/// CPU an append (0.94× at 64 clients over 60 s against 8), and a query visits more
/// segments (at 1,000,000 events every kind's p50 still under 3 ms; bench/RESULTS.md,
/// "Search").
const MERGE_SEGMENTS: usize = 32;
/// The writer's memory for documents between commits (tantivy's minimum is 15 MB a
/// thread).
const WRITER_MEMORY: usize = 48 << 20;
/// Log bytes behind from which the catch-up at open indexes on every core
/// ([`catch_up_threads`]), the store not serving yet: a rebuild from scratch, or an index
/// left behind by a load that took every core. Below it one thread takes tens of
/// milliseconds. A log of 1,000,000 events is rebuilt on two cores in about 0.7× the time
/// of one (7.7–9.0 s against 11.1–11.3 s; bench/RESULTS.md, "Search").
const WIDE_CATCH_UP_BYTES: u64 = 1 << 20;
/// The tokenizer's name in the index's schema.
const WORDS: &str = "agentlog_words";
/// The layout of the documents; a different one in the payload rebuilds the index.
const LAYOUT: &str = "agentlog-search-1";
/// Fork seqs read per step while indexing a shared prefix.
const PREFIX_CHUNK: u64 = 512;
/// Documents handed to tantivy's indexing thread at once. One at a time, each hand-off
/// through its channel could wake that thread, or park this one on a full channel: a
/// quarter of a rebuild's CPU went to the hand-offs and their context switches.
const ADD_BATCH: usize = 512;

#[derive(Debug, thiserror::Error)]
pub enum SearchError {
    #[error("search index: {0}")]
    Tantivy(#[from] tantivy::TantivyError),
    #[error("search index directory {0}: {1}")]
    Dir(String, String),
    #[error("search index: reading the log: {0}")]
    Log(#[from] super::log::LogError),
    #[error("search index: {0}")]
    Store(#[from] StoreError),
}

impl From<SearchError> for StoreError {
    fn from(e: SearchError) -> StoreError {
        match e {
            SearchError::Store(e) => e,
            other => StoreError::Internal(other.to_string()),
        }
    }
}

/// The index's fields.
#[derive(Clone, Copy)]
struct Fields {
    /// The session id, untokenized: deletes and tenants' scopes go by it.
    session: Field,
    seq: Field,
    /// Newest first: the log offset of the record the document came from, shifted, plus
    /// the seq for a fork's shared prefix (indexed at its fork record). Unique, and
    /// growing with the log.
    order: Field,
    words: Field,
}

fn schema() -> (Schema, Fields) {
    let mut builder = Schema::builder();
    let session = builder.add_text_field("session", STRING | STORED);
    let seq = builder.add_u64_field("seq", INDEXED | STORED);
    let order = builder.add_u64_field("order", INDEXED | FAST);
    let words = builder.add_text_field(
        "words",
        TextOptions::default().set_indexing_options(
            TextFieldIndexing::default()
                .set_tokenizer(WORDS)
                .set_index_option(IndexRecordOption::WithFreqsAndPositions),
        ),
    );
    (
        builder.build(),
        Fields {
            session,
            seq,
            order,
            words,
        },
    )
}

/// [`text::words`] as a tantivy tokenizer.
#[derive(Clone)]
struct WordTokenizer;

struct WordStream<'a> {
    text: &'a str,
    spans: text::Spans<'a>,
    token: Token,
}

impl Tokenizer for WordTokenizer {
    type TokenStream<'a> = WordStream<'a>;
    fn token_stream<'a>(&'a mut self, text: &'a str) -> WordStream<'a> {
        WordStream {
            text,
            spans: text::Spans::new(text),
            // Its position starts at `usize::MAX`: the first `advance` wraps it to 0.
            token: Token::default(),
        }
    }
}

impl TokenStream for WordStream<'_> {
    fn advance(&mut self) -> bool {
        let Some((start, end)) = self.spans.next() else {
            return false;
        };
        self.token.offset_from = start;
        self.token.offset_to = end;
        self.token.position = self.token.position.wrapping_add(1);
        self.token.text.clear();
        text::lowercase_into(&self.text[start..end], &mut self.token.text);
        true
    }
    fn token(&self) -> &Token {
        &self.token
    }
    fn token_mut(&mut self) -> &mut Token {
        &mut self.token
    }
}

/// What a commit records: the layout and the log offset read up to.
fn payload(offset: u64) -> String {
    format!("{LAYOUT} {offset}")
}

fn offset_of(payload: Option<&str>) -> Option<u64> {
    payload?.strip_prefix(LAYOUT)?.trim().parse().ok()
}

/// The index, searched by the store's calls; fed by [`Indexer`].
pub struct SearchIndex {
    reader: IndexReader,
    fields: Fields,
    source: Source,
}

/// The single writer of the index: what it has read of the log, and its erasures.
pub struct Indexer {
    writer: IndexWriter,
    reader: IndexReader,
    fields: Fields,
    source: Source,
    /// The log offset read up to (what the next commit records).
    offset: u64,
    /// Documents read and not yet handed to tantivy ([`ADD_BATCH`] at most).
    adding: Vec<TantivyDocument>,
    /// Documents added or deleted since the last commit.
    dirty: bool,
    committed: Instant,
    /// The least time between two commits ([`COMMIT_EVERY`] unless told otherwise).
    commit_every: Duration,
    /// A merge that drops deleted documents, under way (its end is told on the channel).
    erasing: Option<std::sync::mpsc::Receiver<()>>,
}

/// Starts the indexer on a thread of its own at a lower CPU priority ([`NICE`]), which
/// tantivy's threads, started from it, inherit; returns once the index has caught up with
/// the log ([`SearchIndex::open`]). The indexer then follows the log until `stop` fires.
pub fn start(
    dir: &Path,
    commit_every: Duration,
    source: Source,
    stop: Signal,
) -> Result<(Arc<SearchIndex>, std::thread::JoinHandle<()>), SearchError> {
    let (opened_tx, opened) = std::sync::mpsc::sync_channel(1);
    let shown = dir.display().to_string();
    let dir = dir.to_path_buf();
    let thread = std::thread::Builder::new()
        .name("search-indexer".into())
        .spawn(move || {
            lower_priority();
            match SearchIndex::open(&dir, commit_every, source) {
                Ok((index, indexer)) => {
                    if opened_tx.send(Ok(index)).is_ok() {
                        indexer.run(stop);
                    }
                }
                Err(e) => {
                    let _ = opened_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| SearchError::Dir(shown.clone(), format!("the indexer's thread: {e}")))?;
    match opened.recv() {
        Ok(Ok(index)) => Ok((index, thread)),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => Err(SearchError::Dir(
            shown,
            "the indexer's thread ended while opening the index".into(),
        )),
    }
}

/// Lowers the calling thread's CPU priority by [`NICE`] (on Linux a nice value belongs to
/// a thread, and the threads it starts inherit it). Raising a nice value needs no
/// privilege; where it fails anyway, the indexer runs at the store's priority.
fn lower_priority() {
    let tid = rustix::thread::gettid();
    let lowered = rustix::process::getpriority_process(Some(tid))
        .and_then(|now| rustix::process::setpriority_process(Some(tid), (now + NICE).min(19)));
    if let Err(e) = lowered {
        tracing::warn!(error = %e, "the search indexer runs at the store's CPU priority");
    }
}

impl SearchIndex {
    /// Opens the index in `dir` (creating it if need be) and brings it up to the durable
    /// end of the log before returning (see the module head).
    pub fn open(
        dir: &Path,
        commit_every: Duration,
        source: Source,
    ) -> Result<(Arc<SearchIndex>, Indexer), SearchError> {
        let (schema, fields) = schema();
        let index = match open_index(dir, &schema) {
            Ok(index) => index,
            Err(e) => {
                tracing::warn!(error = %e, dir = %dir.display(), "the search index cannot be opened as it is; rebuilding it from the log");
                std::fs::remove_dir_all(dir)
                    .map_err(|e| SearchError::Dir(dir.display().to_string(), e.to_string()))?;
                open_index(dir, &schema)?
            }
        };
        let reader = index
            .reader_builder()
            .reload_policy(ReloadPolicy::Manual)
            .try_into()?;
        let durable = source.shared.durable();
        let offset = match offset_of(index.load_metas()?.payload.as_deref()) {
            Some(offset) if offset <= durable => offset,
            found => {
                if found.is_some() {
                    tracing::warn!(
                        indexed = found,
                        log_end = durable,
                        "the search index is ahead of the log (was the log restored from an older backup?); rebuilding it"
                    );
                }
                0
            }
        };
        let indexer_with = |writer, offset| Indexer {
            writer,
            reader: reader.clone(),
            fields,
            source: source.clone(),
            offset,
            adding: Vec::with_capacity(ADD_BATCH),
            dirty: true,
            committed: Instant::now(),
            commit_every,
            erasing: None,
        };
        let started = Instant::now();
        let threads = match durable - offset {
            behind if behind >= WIDE_CATCH_UP_BYTES => catch_up_threads(),
            _ => 1,
        };
        let mut first = indexer_with(writer(&index, threads)?, offset);
        if threads > 1 {
            // Its segments are merged by the writer that follows it, while the store serves.
            first.writer.set_merge_policy(Box::new(NoMergePolicy));
        }
        if offset == 0 {
            // Nothing of the log is in the index: any document left is from another log.
            first.writer.delete_all_documents()?;
        }
        first.catch_up()?;
        first.commit()?;
        let mut indexer = if threads == 1 {
            first
        } else {
            // Followed from here by one thread: a commit's documents make one segment.
            let caught_up = first.offset;
            first.writer.wait_merging_threads()?;
            indexer_with(writer(&index, 1)?, caught_up)
        };
        if indexer.offset > offset {
            tracing::info!(
                bytes = indexer.offset - offset,
                threads,
                ms = started.elapsed().as_millis() as u64,
                "the search index caught up with the log"
            );
        }
        indexer.erase_deleted()?;
        Ok((
            Arc::new(SearchIndex {
                reader,
                fields,
                source,
            }),
            indexer,
        ))
    }

    /// One page of hits for `op` in `scope`, newest first (blocking: call it off the
    /// runtime).
    pub fn search(
        &self,
        op: &SearchOp,
        scope: &Scope,
    ) -> Result<SearchSessionsResponse, StoreError> {
        let mut before = match op.page_token.as_str() {
            "" => None,
            token => Some(
                token
                    .strip_prefix('l')
                    .and_then(|t| t.parse::<u64>().ok())
                    .ok_or_else(|| {
                        StoreError::InvalidArgument(
                            "page_token: not a token from a previous SearchSessions response"
                                .into(),
                        )
                    })?,
            ),
        };
        let Some(filter) = self.scope_filter(scope) else {
            return Ok(SearchSessionsResponse::default());
        };
        let searcher = self.reader.searcher();
        let mut hits = Vec::new();
        let mut looked = 0;
        let mut round = 0;
        loop {
            let wanted = search::batch_for(op.page_size - hits.len(), round);
            round += 1;
            let mut clauses = self.clauses(&op.query);
            clauses.extend(filter.iter().map(|q| (Occur::Must, q.box_clone())));
            if let Some(before) = before {
                clauses.push((
                    Occur::Must,
                    Box::new(RangeQuery::new(
                        Bound::Unbounded,
                        Bound::Excluded(Term::from_field_u64(self.fields.order, before)),
                    )),
                ));
            }
            let query = BooleanQuery::new(clauses);
            let found = newest(&searcher, &query, wanted).map_err(SearchError::from)?;
            let mut exhausted = found.len() < wanted;
            let count = found.len();
            for (i, (order, address)) in found.into_iter().enumerate() {
                before = Some(order);
                looked += 1;
                let doc: TantivyDocument = searcher.doc(address).map_err(SearchError::from)?;
                let session = doc.get_first(self.fields.session).and_then(|v| v.as_str());
                let seq = doc.get_first(self.fields.seq).and_then(|v| v.as_u64());
                let (Some(session), Some(seq)) = (session, seq) else {
                    continue;
                };
                if let Some(hit) = self.check(&op.query, session, seq)? {
                    hits.push(hit);
                    if hits.len() == op.page_size {
                        // More only if candidates are left after this one.
                        exhausted &= i + 1 == count;
                        break;
                    }
                }
            }
            let full = hits.len() == op.page_size;
            if exhausted || full || looked >= search::MAX_CANDIDATES_PER_PAGE {
                let more = !exhausted;
                return Ok(SearchSessionsResponse {
                    hits,
                    next_page_token: match (more, before) {
                        (true, Some(order)) => format!("l{order}"),
                        _ => String::new(),
                    },
                });
            }
        }
    }

    /// The candidate as a hit, if its session is live and its event, read from the log,
    /// matches.
    fn check(
        &self,
        query: &search::Query,
        session_id: &str,
        seq: u64,
    ) -> Result<Option<agentlog_proto::v1::SearchHit>, StoreError> {
        if self
            .source
            .shared
            .get(session_id)?
            .is_none_or(|m| m.is_deleted())
        {
            return Ok(None);
        }
        let Some(position) = position_of(&self.source, session_id, seq)? else {
            return Ok(None);
        };
        let event = match self.source.log.read(position) {
            Ok(Record::Event(event)) => event.into_event(),
            Ok(Record::Placed(copied)) => copied
                .decode()
                .map_err(|e| StoreError::Internal(format!("{session_id}/{seq}: {e}")))?,
            // The records went with a deletion between the look at the state and the read.
            Ok(_) | Err(_) if self.source.shared.is_deleted(session_id)? => return Ok(None),
            Ok(_) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        Ok(text::searchable(&event).and_then(|s| {
            search::hit(
                query,
                search::Candidate {
                    session_id,
                    seq,
                    ts_unix_ms: event.ts_unix_ms,
                    kind: s.kind,
                    text: &s.text,
                },
            )
        }))
    }

    fn clauses(&self, query: &search::Query) -> Vec<(Occur, Box<dyn Query>)> {
        let words = self.fields.words;
        let term = |w: &str| Term::from_field_text(words, w);
        query
            .clauses
            .iter()
            .map(|clause| -> (Occur, Box<dyn Query>) {
                let query: Box<dyn Query> = match clause {
                    Clause::Word(w) => Box::new(TermQuery::new(term(w), IndexRecordOption::Basic)),
                    // A word is letters and digits only: nothing in it is a regex operator.
                    Clause::Prefix(p) => match RegexQuery::from_pattern(&format!("{p}.*"), words) {
                        Ok(q) => Box::new(q),
                        Err(_) => Box::new(tantivy::query::EmptyQuery),
                    },
                    Clause::Phrase(ws) => {
                        Box::new(PhraseQuery::new(ws.iter().map(|w| term(w)).collect()))
                    }
                };
                (Occur::Must, query)
            })
            .collect()
    }

    /// The scope as a query on session ids (`Some(vec![])`: every session; `None`: none).
    fn scope_filter(&self, scope: &Scope) -> Option<Vec<Box<dyn Query>>> {
        let Some(prefixes) = scope.prefix_list() else {
            return Some(Vec::new());
        };
        if prefixes.is_empty() {
            return None;
        }
        let session = self.fields.session;
        let ranges = prefixes
            .iter()
            .map(|p| -> (Occur, Box<dyn Query>) {
                // Session ids are ASCII below DEL: every id that starts with `p` sorts
                // between `p` and `p` + DEL.
                let upper = format!("{p}\u{7f}");
                (
                    Occur::Should,
                    Box::new(RangeQuery::new(
                        Bound::Included(Term::from_field_text(session, p)),
                        Bound::Excluded(Term::from_field_text(session, &upper)),
                    )),
                )
            })
            .collect();
        Some(vec![Box::new(BooleanQuery::new(ranges))])
    }
}

/// The `wanted` newest live documents matching `query`, newest first, with their order.
///
/// tantivy's `TopDocs` ordered by a fast field reads every match in every segment, which
/// for a common word is most of the index. Here the segments are visited newest first (by
/// the largest order each holds), and a segment whose newest document is older than the
/// `wanted`-th found so far is never opened, nor any after it: a common word is answered
/// from the newest segments, which are the small ones (the indexer commits the log in
/// order, and merges join segments of like size, so of like age).
fn newest(
    searcher: &Searcher,
    query: &dyn Query,
    wanted: usize,
) -> tantivy::Result<Vec<(u64, DocAddress)>> {
    if wanted == 0 {
        return Ok(Vec::new());
    }
    let weight = query.weight(EnableScoring::disabled_from_searcher(searcher))?;
    let mut segments = Vec::new();
    for (ord, reader) in searcher.segment_readers().iter().enumerate() {
        let orders = reader.fast_fields().u64("order")?;
        segments.push((orders.max_value(), ord as u32, reader, orders));
    }
    segments.sort_unstable_by_key(|s| Reverse(s.0));
    // The best `wanted` so far; its least on top.
    let mut top: BinaryHeap<Reverse<(u64, DocAddress)>> = BinaryHeap::with_capacity(wanted + 1);
    for (newest_here, ord, reader, orders) in segments {
        if top.len() == wanted
            && top
                .peek()
                .is_some_and(|Reverse((least, _))| newest_here <= *least)
        {
            break;
        }
        let alive = reader.alive_bitset();
        weight.for_each_no_score(reader, &mut |docs| {
            for &doc in docs {
                if alive.is_some_and(|a| !a.is_alive(doc)) {
                    continue;
                }
                let Some(order) = orders.first(doc) else {
                    continue;
                };
                if top.len() < wanted {
                    top.push(Reverse((order, DocAddress::new(ord, doc))));
                } else if top.peek().is_some_and(|Reverse((least, _))| order > *least) {
                    top.pop();
                    top.push(Reverse((order, DocAddress::new(ord, doc))));
                }
            }
        })?;
    }
    let mut found: Vec<(u64, DocAddress)> = top.into_iter().map(|Reverse(d)| d).collect();
    found.sort_unstable_by_key(|d| Reverse(d.0));
    Ok(found)
}

/// The index's single writer, indexing on `threads` threads.
fn writer(index: &Index, threads: usize) -> Result<IndexWriter, SearchError> {
    let writer = index.writer_with_num_threads(threads, WRITER_MEMORY)?;
    let mut merges = LogMergePolicy::default();
    merges.set_min_num_segments(MERGE_SEGMENTS);
    writer.set_merge_policy(Box::new(merges));
    Ok(writer)
}

/// Threads for a long catch-up at open, when the store does not serve yet: one a core
/// (as the process may use them), as many as [`WRITER_MEMORY`] holds at tantivy's
/// minimum of 15 MB a thread.
fn catch_up_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.clamp(1, WRITER_MEMORY / 15_000_000)
}

fn open_index(dir: &Path, schema: &Schema) -> Result<Index, SearchError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| SearchError::Dir(dir.display().to_string(), e.to_string()))?;
    let directory = MmapDirectory::open(dir)
        .map_err(|e| SearchError::Dir(dir.display().to_string(), e.to_string()))?;
    let index = Index::open_or_create(directory, schema.clone())?;
    index.tokenizers().register(WORDS, WordTokenizer);
    Ok(index)
}

impl Indexer {
    /// Follows the log until `stop` fires (see the module head).
    pub fn run(mut self, stop: Signal) {
        loop {
            if let Err(e) = self.step() {
                // The offset did not move: what failed is read again at the next look.
                tracing::error!(error = %e, "the search index could not follow the log; trying again");
                self.retry_later();
                if stop.rest(Duration::from_secs(1)) {
                    break;
                }
                continue;
            }
            // With documents waiting, the next look is the next commit's: the writer's
            // wake-up after every fsync is not followed (under load that would be a read of
            // the log per fsync); idle, the first append after the pause is read at once.
            let stopping = if self.dirty {
                stop.rest(self.commit_every.saturating_sub(self.committed.elapsed()))
            } else {
                stop.wait(self.commit_every)
            };
            if stopping {
                break;
            }
        }
        if let Err(e) = self.catch_up().and_then(|()| self.commit()) {
            tracing::warn!(error = %e, "the search index's last commit failed; it catches up at the next open");
        }
        if let Some(erasing) = self.erasing.take() {
            let _ = erasing.recv();
        }
    }

    /// Reads what is new, commits when due, erases what deletions left.
    fn step(&mut self) -> Result<(), SearchError> {
        self.catch_up()?;
        if self.dirty && self.committed.elapsed() >= self.commit_every {
            self.commit()?;
        }
        self.erase_deleted()
    }

    /// A failed step's documents are dropped: they are read again from the offset of the
    /// last commit.
    fn retry_later(&mut self) {
        self.adding.clear();
        if let Err(e) = self.writer.rollback() {
            tracing::error!(error = %e, "the search index could not roll back");
        }
        if let Ok(metas) = self.reader.searcher().index().load_metas() {
            if let Some(offset) = offset_of(metas.payload.as_deref()) {
                self.offset = offset;
            }
        }
    }

    /// Indexes the log from the offset read up to its durable end.
    fn catch_up(&mut self) -> Result<(), SearchError> {
        let to = self.source.shared.durable();
        if to <= self.offset {
            return Ok(());
        }
        let log: Arc<LogReader> = self.source.log.clone();
        let mut failure: Option<SearchError> = None;
        log.scan(self.offset, to, &mut |append: &[(Position, Record)]| {
            if failure.is_some() {
                return;
            }
            for (position, record) in append {
                if let Err(e) = self.absorb(*position, record) {
                    failure = Some(e);
                    return;
                }
            }
        })?;
        if let Some(e) = failure {
            return Err(e);
        }
        self.hand_over()?;
        self.offset = to;
        Ok(())
    }

    fn absorb(&mut self, position: Position, record: &Record) -> Result<(), SearchError> {
        let order = position.offset << 20;
        match record {
            // An import's staging session is never shown: its events are indexed under the
            // session its commit (a fork-like start) makes visible.
            Record::Event(event) if is_staging(&event.session_id) => {}
            Record::Event(event) => self.add(&event.session_id, event, order)?,
            Record::Placed(copied) => {
                let event = copied
                    .decode()
                    .map_err(|e| StoreError::Internal(format!("a placed record: {e}")))?;
                self.forget(&copied.session_id, Some(copied.seq))?;
                self.add(&copied.session_id, &event, order)?;
            }
            Record::Fork(fork) => self.add_prefix(&fork.session_id, fork.seq, order)?,
            Record::Tombstone(tombstone) => self.forget(&tombstone.session_id, None)?,
            Record::Lease(_) | Record::Pin(_) => {}
        }
        Ok(())
    }

    fn add(&mut self, session_id: &str, event: &Event, order: u64) -> Result<(), SearchError> {
        let Some(searchable) = text::searchable(event) else {
            return Ok(());
        };
        let f = self.fields;
        self.adding.push(doc!(
            f.session => session_id,
            f.seq => event.seq,
            f.order => order,
            f.words => searchable.text,
        ));
        self.dirty = true;
        if self.adding.len() >= ADD_BATCH {
            self.hand_over()?;
        }
        Ok(())
    }

    /// Hands the documents read so far to tantivy's indexing threads, in one batch.
    fn hand_over(&mut self) -> Result<(), SearchError> {
        if !self.adding.is_empty() {
            self.writer
                .run(self.adding.drain(..).map(UserOperation::Add))?;
        }
        Ok(())
    }

    /// A fork's seqs `1..=up_to`, read through its base, indexed as its own.
    fn add_prefix(&mut self, fork: &str, up_to: u64, order: u64) -> Result<(), SearchError> {
        let mut from = 1;
        while from <= up_to {
            let read = read_up_to(&self.source, fork, from, up_to.min(from + PREFIX_CHUNK - 1));
            let pieces = match read {
                Ok((pieces, _, _)) => pieces,
                // A fork deleted since, or whose base went after its prefix was made its own:
                // a tombstone, or the placed records, follow in the log.
                Err(_) if self.prefix_follows(fork)? => return Ok(()),
                Err(e) => return Err(e.into()),
            };
            let mut read_any = false;
            for piece in pieces {
                for event in piece.decode()? {
                    read_any = true;
                    from = from.max(event.seq + 1);
                    if event.seq <= up_to {
                        self.add(fork, &event, order | event.seq.min((1 << 20) - 1))?;
                    }
                }
            }
            if !read_any {
                break;
            }
        }
        Ok(())
    }

    /// Whether a fork's prefix, unreadable through its base, comes later in the log: it
    /// was deleted, or its prefix was made its own.
    fn prefix_follows(&self, fork: &str) -> Result<bool, SearchError> {
        Ok(self
            .source
            .shared
            .get(fork)?
            .is_none_or(|m| m.is_deleted() || m.base_session.is_empty()))
    }

    /// Deletes the documents of a session (of one seq of it, for `Some`).
    fn forget(&mut self, session_id: &str, seq: Option<u64>) -> Result<(), SearchError> {
        // A delete covers the documents handed over before it, not those still held here.
        self.hand_over()?;
        let f = self.fields;
        let session = Term::from_field_text(f.session, session_id);
        match seq {
            None => {
                self.writer.delete_term(session);
            }
            Some(seq) => {
                self.writer.delete_query(Box::new(BooleanQuery::new(vec![
                    (
                        Occur::Must,
                        Box::new(TermQuery::new(session, IndexRecordOption::Basic)),
                    ),
                    (
                        Occur::Must,
                        Box::new(TermQuery::new(
                            Term::from_field_u64(f.seq, seq),
                            IndexRecordOption::Basic,
                        )),
                    ),
                ])))?;
            }
        }
        self.dirty = true;
        Ok(())
    }

    fn commit(&mut self) -> Result<(), SearchError> {
        if !self.dirty {
            return Ok(());
        }
        self.hand_over()?;
        let mut commit = self.writer.prepare_commit()?;
        commit.set_payload(&payload(self.offset));
        commit.commit()?;
        self.reader.reload()?;
        self.dirty = false;
        self.committed = Instant::now();
        Ok(())
    }

    /// Merges the segments that hold deleted documents, so that their words leave the
    /// files, and removes the files no commit needs.
    fn erase_deleted(&mut self) -> Result<(), SearchError> {
        if let Some(erasing) = &self.erasing {
            match erasing.try_recv() {
                Err(std::sync::mpsc::TryRecvError::Empty) => return Ok(()),
                _ => {
                    self.erasing = None;
                    self.reader.reload()?;
                    self.writer.garbage_collect_files().wait()?;
                }
            }
        }
        let metas = self.reader.searcher().index().load_metas()?;
        let with_deletes: Vec<_> = metas
            .segments
            .iter()
            .filter(|s| s.has_deletes())
            .map(|s| s.id())
            .collect();
        if with_deletes.is_empty() {
            return Ok(());
        }
        let merge = self.writer.merge(&with_deletes);
        let (done, erasing) = std::sync::mpsc::channel();
        let waiter = std::thread::Builder::new()
            .name("search-erase".into())
            .spawn(move || {
                if let Err(e) = merge.wait() {
                    // Another merge holds one of the segments: tried again at the next look.
                    tracing::debug!(error = %e, "a search index merge did not run");
                }
                let _ = done.send(());
            });
        if waiter.is_ok() {
            self.erasing = Some(erasing);
        }
        Ok(())
    }
}

/// The index's directory in a data directory.
pub fn dir_in(data_dir: &Path) -> PathBuf {
    data_dir.join("search")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tokenizer_yields_the_words_of_the_text_with_their_positions() {
        let text = "Ran `terraform destroy` in /srv/ΟΔΟΣ, then Ran again";
        let mut tokenizer = WordTokenizer;
        let mut stream = tokenizer.token_stream(text);
        let mut tokens = Vec::new();
        while stream.advance() {
            let t = stream.token();
            tokens.push((t.position, t.offset_from, t.offset_to, t.text.clone()));
        }
        let expected: Vec<_> = text::words(text)
            .enumerate()
            .map(|(i, w)| (i, w.start, w.end, w.text))
            .collect();
        assert_eq!(tokens, expected);
    }

    /// Segments of every age and size, out of order as merges leave them, with deleted
    /// documents: [`newest`] answers what reading every match would, for every page size.
    #[test]
    fn newest_skips_old_segments_and_finds_what_reading_every_match_finds() {
        let (schema, fields) = schema();
        let index = Index::create_in_ram(schema);
        index.tokenizers().register(WORDS, WordTokenizer);
        let mut writer: IndexWriter = index.writer_with_num_threads(1, 15_000_000).unwrap();
        // Batches of orders, each one commit (one segment): a big old one, then smaller
        // newer ones, and one committed late that holds old orders.
        let batches: [std::ops::Range<u64>; 5] = [
            0..4_000,
            4_000..4_500,
            9_000..9_040,
            4_500..9_000,
            9_040..9_050,
        ];
        for batch in batches {
            for order in batch {
                let text = if order % 3 == 0 {
                    "common rare"
                } else {
                    "common"
                };
                writer
                    .add_document(doc!(
                        fields.session => format!("s{}", order % 7),
                        fields.seq => order,
                        fields.order => order,
                        fields.words => text,
                    ))
                    .unwrap();
            }
            writer.commit().unwrap();
        }
        // Deleted: a whole session's documents, the newest among them.
        writer.delete_term(Term::from_field_text(fields.session, "s1"));
        writer.commit().unwrap();
        let reader = index.reader().unwrap();
        let searcher = reader.searcher();
        assert!(searcher.segment_readers().len() >= 2);
        for word in ["common", "rare"] {
            let query = TermQuery::new(
                Term::from_field_text(fields.words, word),
                IndexRecordOption::Basic,
            );
            let mut every: Vec<u64> = (0..9_050)
                .filter(|o| o % 7 != 1 && (word == "common" || o % 3 == 0))
                .collect();
            every.reverse();
            for wanted in [0, 1, 20, 41, 500, 20_000] {
                let found: Vec<u64> = newest(&searcher, &query, wanted)
                    .unwrap()
                    .into_iter()
                    .map(|(order, _)| order)
                    .collect();
                let expected: Vec<u64> = every.iter().copied().take(wanted).collect();
                assert_eq!(found, expected, "{word}, {wanted} wanted");
            }
        }
    }
}
