//! Helpers shared by the grammar test binaries: the scheme texts the repository ships, and
//! assertions on where an error points.
// Each test binary uses its own subset of these.
#![allow(dead_code)]

use kvq_spec::*;

/// The text of every `#[scheme(...)]` in the built-in schemes' source, so the runtime parser is
/// checked on exactly what the attribute is given.
pub fn builtin_texts() -> Vec<String> {
    let src = include_str!("../../../kvq/src/schemes.rs");
    let mut out = Vec::new();
    for (at, _) in src.match_indices("#[scheme(") {
        let body = &src[at + "#[scheme(".len()..];
        let mut depth = 1;
        let end = body
            .char_indices()
            .find(|&(_, c)| {
                depth += match c {
                    '(' => 1,
                    ')' => -1,
                    _ => 0,
                };
                depth == 0
            })
            .map(|(i, _)| i)
            .expect("balanced #[scheme(...)]");
        out.push(body[..end].to_string());
    }
    out
}

/// The ```` ```text scheme ```` blocks of docs/GRAMMAR.md: (info string, text).
pub fn doc_blocks() -> Vec<(String, String)> {
    let doc = include_str!("../../../../docs/GRAMMAR.md");
    let mut out = Vec::new();
    let mut lines = doc.lines();
    while let Some(line) = lines.next() {
        let Some(info) = line.strip_prefix("```text ") else {
            continue;
        };
        let body: Vec<&str> = lines
            .by_ref()
            .take_while(|l| !l.starts_with("```"))
            .collect();
        out.push((info.trim().to_string(), body.join("\n")));
    }
    out
}

pub fn parse(text: &str) -> SchemeSpec {
    SchemeSpec::parse(text).unwrap_or_else(|e| panic!("{}", e.render(text)))
}

/// The message and the text under the span of the error `text` gives.
pub fn error(text: &str) -> (String, String) {
    match SchemeSpec::parse(text) {
        Ok(spec) => panic!("`{text}` parsed as `{spec}`"),
        Err(e) => {
            let under = text.get(e.span.clone()).unwrap_or_else(|| {
                panic!("span {:?} is not inside `{text}` ({})", e.span, e.message)
            });
            (e.message, under.to_string())
        }
    }
}

/// Asserts that `text` fails with a message containing `message` on exactly the text `under`.
#[track_caller]
pub fn fails(text: &str, message: &str, under: &str) {
    let (got, got_under) = error(text);
    assert!(
        got.contains(message),
        "`{text}`: message `{got}` lacks `{message}`"
    );
    assert_eq!(got_under, under, "`{text}`: wrong span for `{got}`");
}
