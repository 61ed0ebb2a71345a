//! Turns attribute tokens back into scheme text while remembering which byte range each token
//! occupies, so a parser error's byte span maps back to a source span.

use proc_macro2::{Delimiter, Span, TokenStream, TokenTree};
use std::ops::Range;

/// Scheme text rebuilt from tokens, with the byte range each token occupies.
pub struct TokenText {
    pub text: String,
    spans: Vec<(Range<usize>, Span)>,
}

impl TokenText {
    pub fn new(tokens: TokenStream) -> Self {
        let mut t = TokenText {
            text: String::new(),
            spans: Vec::new(),
        };
        t.push_stream(tokens);
        t
    }

    fn push(&mut self, piece: &str, span: Span) {
        // Words and numbers need a separator; punctuation does not (keeps `-0.5` one number).
        let needs_space = self
            .text
            .chars()
            .last()
            .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.')
            && piece
                .chars()
                .next()
                .is_some_and(|c| c.is_alphanumeric() || c == '_');
        if needs_space {
            self.text.push(' ');
        }
        let start = self.text.len();
        self.text.push_str(piece);
        self.spans.push((start..self.text.len(), span));
    }

    /// Flattens `tokens` with an explicit stack of open groups rather than recursion, so however
    /// deeply the attribute nests, the macro's stack stays flat (the parser then refuses the depth
    /// with an error on the offending call).
    fn push_stream(&mut self, tokens: TokenStream) {
        let mut open: Vec<(proc_macro2::token_stream::IntoIter, Option<(&str, Span)>)> =
            vec![(tokens.into_iter(), None)];
        while let Some((iter, _)) = open.last_mut() {
            let Some(tree) = iter.next() else {
                if let Some((_, Some((close, span)))) = open.pop() {
                    self.push(close, span);
                }
                continue;
            };
            match tree {
                TokenTree::Group(g) => {
                    let (opening, close) = match g.delimiter() {
                        Delimiter::Parenthesis => ("(", ")"),
                        Delimiter::Bracket => ("[", "]"),
                        Delimiter::Brace => ("{", "}"),
                        Delimiter::None => ("", ""),
                    };
                    self.push(opening, g.span_open());
                    open.push((g.stream().into_iter(), Some((close, g.span_close()))));
                }
                TokenTree::Ident(i) => self.push(&i.to_string(), i.span()),
                TokenTree::Punct(p) => self.push(&p.as_char().to_string(), p.span()),
                TokenTree::Literal(l) => self.push(&l.to_string(), l.span()),
            }
        }
    }

    /// The first and last token overlapping `bytes`; an empty range (something missing at that
    /// point) maps to the token it touches, or the last token at the end of the text.
    pub fn spans_of(&self, bytes: Range<usize>) -> (Span, Span) {
        let hit = |r: &Range<usize>| {
            if bytes.is_empty() {
                r.start <= bytes.start && bytes.start < r.end
            } else {
                r.start < bytes.end && bytes.start < r.end
            }
        };
        let mut found = self.spans.iter().filter(|(r, _)| hit(r)).map(|(_, s)| *s);
        let fallback = self.spans.last().map_or(Span::call_site(), |(_, s)| *s);
        let first = found.next().unwrap_or(fallback);
        (first, found.next_back().unwrap_or(first))
    }
}
