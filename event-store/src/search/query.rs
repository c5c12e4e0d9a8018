//! What a `SearchSessions` query means. Words separated by spaces, all of which must occur
//! in the same event; a word ending in `*` is a prefix; "a quoted phrase" is its words in
//! that order; a word with separators inside (`terraform-destroy`, `src/main.rs`) is the
//! phrase of its words. Words are matched whole and case-insensitively
//! ([`super::text::words`]), without stemming.
//!
//! Refused, with a message that says which: a query over [`MAX_QUERY_BYTES`], an empty one
//! (nothing but spaces), an unclosed quote, and one with no word in it at all.

use super::text::{self, Word};

/// A query is at most this long (bytes).
pub const MAX_QUERY_BYTES: usize = 1024;

/// One condition an event must meet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Clause {
    Word(String),
    /// A word that starts with this.
    Prefix(String),
    /// These words, one right after another (at least two).
    Phrase(Vec<String>),
}

/// A parsed query: every clause must hold in one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    pub clauses: Vec<Clause>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueryError {
    #[error("query: {0} bytes, over the limit of {MAX_QUERY_BYTES}")]
    TooLong(usize),
    #[error("query: empty; give at least one word to search for")]
    Empty,
    #[error("query: the quote at character {0} is not closed")]
    UnclosedQuote(usize),
    #[error("query: no word to search for (words are letters and digits)")]
    NoWords,
}

/// Parses `query` (see the module head).
pub fn parse(query: &str) -> Result<Query, QueryError> {
    if query.len() > MAX_QUERY_BYTES {
        return Err(QueryError::TooLong(query.len()));
    }
    if query.trim().is_empty() {
        return Err(QueryError::Empty);
    }
    let mut clauses = Vec::new();
    let mut rest = query;
    let mut consumed = 0;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix('"') {
            let Some(close) = after.find('"') else {
                return Err(QueryError::UnclosedQuote(
                    query[..consumed].chars().count() + 1,
                ));
            };
            push_words(&mut clauses, &after[..close], false);
            let used = close + 2;
            consumed += used;
            rest = &rest[used..];
            continue;
        }
        let end = rest
            .find(|c: char| c.is_whitespace() || c == '"')
            .unwrap_or(rest.len());
        let chunk = &rest[..end];
        let prefix = chunk.ends_with('*');
        push_words(&mut clauses, chunk.trim_end_matches('*'), prefix);
        let skip = rest[end..]
            .find(|c: char| !c.is_whitespace())
            .map_or(rest.len() - end, |i| i);
        consumed += end + skip;
        rest = &rest[end + skip..];
    }
    if clauses.is_empty() {
        return Err(QueryError::NoWords);
    }
    Ok(Query { clauses })
}

/// The clauses of one chunk of the query: its words as a word, a prefix or a phrase.
fn push_words(clauses: &mut Vec<Clause>, chunk: &str, prefix: bool) {
    let mut words: Vec<String> = text::words(chunk).map(|w| w.text).collect();
    let last = if prefix { words.pop() } else { None };
    match words.len() {
        0 => {}
        1 => clauses.push(Clause::Word(words.remove(0))),
        _ => clauses.push(Clause::Phrase(words)),
    }
    if let Some(last) = last {
        clauses.push(Clause::Prefix(last));
    }
}

impl Query {
    /// Where the first clause matches in `words` (a text's words), if every clause does.
    pub fn first_match(&self, words: &[Word]) -> Option<usize> {
        let mut first = usize::MAX;
        for clause in &self.clauses {
            first = first.min(clause.find(words)?);
        }
        Some(first)
    }

    /// Whether every clause matches in `text`.
    pub fn matches(&self, text: &str) -> bool {
        let words: Vec<Word> = text::words(text).collect();
        self.first_match(&words).is_some()
    }
}

impl Clause {
    /// The index of the first word where this clause matches.
    pub fn find(&self, words: &[Word]) -> Option<usize> {
        match self {
            Clause::Word(w) => words.iter().position(|x| &x.text == w),
            Clause::Prefix(p) => words.iter().position(|x| x.text.starts_with(p.as_str())),
            Clause::Phrase(phrase) => words
                .windows(phrase.len())
                .position(|window| window.iter().zip(phrase).all(|(x, w)| &x.text == w)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(s: &str) -> Clause {
        Clause::Word(s.into())
    }

    #[test]
    fn words_prefixes_and_phrases() {
        let q = parse(r#"  Terraform destr* "flaky TEST" src/main.rs "#).unwrap();
        assert_eq!(
            q.clauses,
            vec![
                w("terraform"),
                Clause::Prefix("destr".into()),
                Clause::Phrase(vec!["flaky".into(), "test".into()]),
                Clause::Phrase(vec!["src".into(), "main".into(), "rs".into()]),
            ]
        );
        assert_eq!(parse(r#""one""#).unwrap().clauses, vec![w("one")]);
        assert_eq!(
            parse("a\"b c\"d").unwrap().clauses,
            vec![w("a"), Clause::Phrase(vec!["b".into(), "c".into()]), w("d")]
        );
    }

    #[test]
    fn bad_queries_say_what_is_wrong() {
        assert_eq!(parse("   "), Err(QueryError::Empty));
        assert_eq!(parse(""), Err(QueryError::Empty));
        assert_eq!(parse(r#"ok "open"#), Err(QueryError::UnclosedQuote(4)));
        assert_eq!(parse(&"a".repeat(1025)), Err(QueryError::TooLong(1025)));
        assert!(parse(&"a ".repeat(512)).is_ok());
        assert_eq!(parse("*** !!"), Err(QueryError::NoWords));
        assert!(parse(r#"ok "open"#)
            .unwrap_err()
            .to_string()
            .contains("not closed"));
    }

    #[test]
    fn matching_is_whole_words_case_insensitive_without_stemming() {
        let q = |s: &str| parse(s).unwrap();
        let text = "We ran Terraform destroy on the staging cluster; tests were flaky.";
        assert!(q("terraform DESTROY").matches(text));
        assert!(q("\"terraform destroy\"").matches(text));
        assert!(!q("\"destroy terraform\"").matches(text));
        assert!(!q("destroyed").matches(text));
        assert!(!q("test").matches(text), "no stemming: tests is not test");
        assert!(q("test*").matches(text));
        assert!(!q("terra").matches(text), "whole words only");
        assert!(!q("terraform missing").matches(text), "every word");
    }
}
