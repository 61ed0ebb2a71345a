//! Tokenizer and parser for the untyped scheme tree.

use crate::error::shown;
use crate::SpecError;
use std::ops::Range;

/// A value in the untyped tree.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    /// `text` is kept so that `f32` fields parse from the digits, not through `f64` (exact round trips).
    Number {
        value: f64,
        text: String,
        span: Range<usize>,
    },
    Word {
        name: String,
        span: Range<usize>,
    },
    Call {
        name: String,
        span: Range<usize>,
        args: Vec<Arg>,
    },
}

impl Value {
    pub(crate) fn span(&self) -> Range<usize> {
        match self {
            Value::Number { span, .. } | Value::Word { span, .. } | Value::Call { span, .. } => {
                span.clone()
            }
        }
    }

    /// How messages quote this value: `4`, `chanel`, `boost(...)`.
    pub(crate) fn quoted(&self) -> String {
        match self {
            Value::Number { text, .. } => format!("`{}`", shown(text)),
            Value::Word { name, .. } => format!("`{}`", shown(name)),
            Value::Call { name, .. } => format!("`{}(...)`", shown(name)),
        }
    }
}

/// `key = value` or a positional value inside a call.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Arg {
    pub key: Option<(String, Range<usize>)>,
    pub value: Value,
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Word(String),
    Number(f64, String),
    Eq,
    Comma,
    Open,
    Close,
}

fn describe(tok: &Tok) -> String {
    match tok {
        Tok::Word(w) => format!("`{}`", shown(w)),
        Tok::Number(_, text) => format!("`{}`", shown(text)),
        Tok::Eq => "`=`".into(),
        Tok::Comma => "`,`".into(),
        Tok::Open => "`(`".into(),
        Tok::Close => "`)`".into(),
    }
}

/// A number: optional sign, digits with an optional fraction and exponent (`-0.5`, `.25`, `1e-3`,
/// `1_000`). Anything glued to it (`4bit`, `0.5f32`) makes the whole run a bad number.
fn number(text: &str, start: usize) -> Result<(Tok, usize), SpecError> {
    let bytes = text.as_bytes();
    let mut i = start + 1;
    while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || matches!(bytes[i], b'.' | b'_')) {
        if matches!(bytes[i], b'e' | b'E') && matches!(bytes.get(i + 1), Some(b'-' | b'+')) {
            i += 1;
        }
        i += 1;
    }
    let raw = &text[start..i];
    let digits = raw.replace('_', "");
    let unsigned = digits.trim_start_matches(['-', '+']);
    // `f64::from_str` also takes `inf` and `nan`; the grammar does not.
    let starts_numeric = unsigned.starts_with(|c: char| c.is_ascii_digit() || c == '.');
    match digits.parse::<f64>() {
        Ok(value) if starts_numeric && value.is_finite() => Ok((Tok::Number(value, digits), i)),
        _ => Err(SpecError::new(
            start..i,
            format!("`{}` is not a number", shown(raw)),
        )),
    }
}

fn tokenize(text: &str) -> Result<Vec<(Tok, Range<usize>)>, SpecError> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        let tok = match bytes[i] {
            c if c.is_ascii_whitespace() => {
                i += 1;
                continue;
            }
            b'=' => Tok::Eq,
            b',' => Tok::Comma,
            b'(' => Tok::Open,
            b')' => Tok::Close,
            b'a'..=b'z' | b'A'..=b'Z' | b'_' => {
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                    i += 1;
                }
                out.push((Tok::Word(text[start..i].to_string()), start..i));
                continue;
            }
            b'0'..=b'9' | b'.' | b'-' | b'+' => {
                let (tok, end) = number(text, start)?;
                i = end;
                out.push((tok, start..end));
                continue;
            }
            _ => {
                let ch = text[start..].chars().next().unwrap_or('?');
                return Err(SpecError::new(
                    start..start + ch.len_utf8(),
                    format!("unexpected character `{ch}`"),
                ));
            }
        };
        out.push((tok, start..start + 1));
        i += 1;
    }
    Ok(out)
}

/// The deepest nesting of calls the parser accepts.
///
/// The grammar's deepest valid scheme nests two calls (`k = int(..., boost = boost(...))`); 32 leaves
/// room for any mistake a person makes to be reported as itself by the interpreter, while bounding the
/// parser's recursion (one `value` and one `args` frame per level, well under 1 KiB together even
/// unoptimised) to a few tens of KiB of stack. Without a bound, text nested a few thousand calls deep
/// overflows a thread's stack and aborts the process.
pub const MAX_NESTING: usize = 32;

struct Parser {
    toks: Vec<(Tok, Range<usize>)>,
    pos: usize,
    /// Calls open around the value being parsed.
    depth: usize,
}

impl Parser {
    fn peek(&self) -> Option<&(Tok, Range<usize>)> {
        self.toks.get(self.pos)
    }

    /// An empty span just after the last token: where the missing piece should have been.
    fn end_span(&self) -> Range<usize> {
        let end = self.toks.last().map_or(0, |(_, s)| s.end);
        end..end
    }

    fn next(&mut self, expected: &str) -> Result<(Tok, Range<usize>), SpecError> {
        match self.toks.get(self.pos) {
            Some(t) => {
                self.pos += 1;
                Ok(t.clone())
            }
            None => Err(SpecError::new(
                self.end_span(),
                format!("expected {expected}, found the end of the scheme"),
            )),
        }
    }

    fn key(&mut self) -> Result<(String, Range<usize>), SpecError> {
        const EXPECTED: &str = "a key such as `k`, `v` or `sink`";
        match self.next(EXPECTED)? {
            (Tok::Word(w), span) => Ok((w, span)),
            (tok, span) => Err(SpecError::new(
                span,
                format!("expected {EXPECTED}, found {}", describe(&tok)),
            )),
        }
    }

    fn value(&mut self) -> Result<Value, SpecError> {
        match self.next("a value")? {
            (Tok::Number(value, text), span) => Ok(Value::Number { value, text, span }),
            (Tok::Word(name), span) => {
                if !matches!(self.peek(), Some((Tok::Open, _))) {
                    return Ok(Value::Word { name, span });
                }
                self.pos += 1;
                let opening = span.start..self.toks[self.pos - 1].1.end;
                if self.depth == MAX_NESTING {
                    return Err(SpecError::new(
                        opening,
                        format!(
                            "`{}(` nests calls {} deep; scheme text allows at most \
                             {MAX_NESTING} (a valid scheme needs 2)",
                            shown(&name),
                            MAX_NESTING + 1
                        ),
                    ));
                }
                self.depth += 1;
                let args = self.args(&name, opening)?;
                self.depth -= 1;
                Ok(Value::Call {
                    name,
                    span: span.start..self.toks[self.pos - 1].1.end,
                    args,
                })
            }
            (tok, span) => Err(SpecError::new(
                span,
                format!("expected a value, found {}", describe(&tok)),
            )),
        }
    }

    /// The arguments of `name(` up to and including its `)`.
    fn args(&mut self, name: &str, opening: Range<usize>) -> Result<Vec<Arg>, SpecError> {
        let mut args = Vec::new();
        loop {
            match self.peek() {
                Some((Tok::Close, _)) => {
                    self.pos += 1;
                    return Ok(args);
                }
                // An unclosed call is reported at its opening, which is what needs the `)`.
                None => {
                    return Err(SpecError::new(
                        opening,
                        format!("`{}(` is never closed: expected `)`", shown(name)),
                    ))
                }
                _ => {}
            }
            let keyed = matches!(
                (self.toks.get(self.pos), self.toks.get(self.pos + 1)),
                (Some((Tok::Word(_), _)), Some((Tok::Eq, _)))
            );
            let key = if keyed {
                let key = self.key()?;
                self.pos += 1; // `=`
                Some(key)
            } else {
                None
            };
            args.push(Arg {
                key,
                value: self.value()?,
            });
            match self.peek() {
                Some((Tok::Comma, _)) => self.pos += 1,
                Some((Tok::Close, _)) | None => {}
                Some((tok, span)) => {
                    return Err(SpecError::new(
                        span.clone(),
                        format!("expected `,` or `)`, found {}", describe(tok)),
                    ))
                }
            }
        }
    }
}

/// Parses `key = value, ...` into keyed values.
pub(crate) fn parse_items(text: &str) -> Result<Vec<Arg>, SpecError> {
    let toks = tokenize(text)?;
    if toks.is_empty() {
        return Err(SpecError::new(
            0..text.len(),
            "empty scheme: declare at least `k = ...` and `v = ...`",
        ));
    }
    let mut p = Parser {
        toks,
        pos: 0,
        depth: 0,
    };
    let mut items = Vec::new();
    while p.peek().is_some() {
        let key = p.key()?;
        let (tok, span) = p.next(&format!("`=` after `{}`", shown(&key.0)))?;
        if tok != Tok::Eq {
            return Err(SpecError::new(
                span,
                format!(
                    "expected `=` after `{}`, found {}",
                    shown(&key.0),
                    describe(&tok)
                ),
            ));
        }
        items.push(Arg {
            key: Some(key),
            value: p.value()?,
        });
        match p.peek() {
            Some((Tok::Comma, _)) => p.pos += 1,
            None => break,
            Some((tok, span)) => {
                return Err(SpecError::new(
                    span.clone(),
                    format!("expected `,` between items, found {}", describe(tok)),
                ))
            }
        }
    }
    Ok(items)
}
