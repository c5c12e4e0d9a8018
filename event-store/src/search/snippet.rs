//! How a hit is shown: the event's text around its first match, on one line, cut at word
//! boundaries, with "…" where text was left out.

use super::text::Word;

/// Words shown before the match, at most.
const WORDS_BEFORE: usize = 8;
/// Characters a snippet holds, about (it ends at the end of a word).
const SNIPPET_CHARS: usize = 200;

/// The snippet of `text` (whose words are `words`) around word `at`.
pub fn around(text: &str, words: &[Word], at: usize) -> String {
    let Some(matched) = words.get(at) else {
        return one_line(text, 0, text.len());
    };
    let first = at.saturating_sub(WORDS_BEFORE);
    let start = if first == 0 { 0 } else { words[first].start };
    let mut end = matched.end;
    for word in &words[at..] {
        if text[start..word.end].chars().count() > SNIPPET_CHARS && word.start > matched.start {
            break;
        }
        end = word.end;
    }
    if !words.iter().any(|w| w.start >= end) {
        end = text.len();
    }
    one_line(text, start, end)
}

/// `text[start..end]` with whitespace runs made single spaces, "…" where it was cut.
fn one_line(text: &str, start: usize, end: usize) -> String {
    let mut out = String::new();
    if start > 0 {
        out.push('…');
    }
    let mut space = false;
    for c in text[start..end].chars() {
        if c.is_whitespace() {
            space = !out.is_empty() && !out.ends_with('…');
            continue;
        }
        if space {
            out.push(' ');
            space = false;
        }
        out.push(c);
    }
    if end < text.len() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::search::text::words;

    fn snip(text: &str, at_word: &str) -> String {
        let ws: Vec<Word> = words(text).collect();
        let at = ws.iter().position(|w| w.text == at_word).unwrap();
        around(text, &ws, at)
    }

    #[test]
    fn a_short_text_is_shown_whole_on_one_line() {
        assert_eq!(
            snip("run\n  terraform   destroy\n", "destroy"),
            "run terraform destroy"
        );
    }

    #[test]
    fn a_long_text_is_cut_around_the_match() {
        let before = "alpha ".repeat(50);
        let after = " omega".repeat(100);
        let text = format!("{before}needle{after}");
        let s = snip(&text, "needle");
        assert!(s.starts_with('…') && s.ends_with('…'), "{s}");
        assert!(s.contains("alpha needle omega"), "{s}");
        assert!(s.chars().count() < 260, "{}", s.len());
    }
}
