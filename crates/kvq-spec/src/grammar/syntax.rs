//! Tokenizer and parser for the untyped scheme tree.

use crate::SpecError;
use std::ops::Range;

/// A value in the untyped tree.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    Number { value: f64, span: Range<usize> },
    Word { name: String, span: Range<usize> },
    Call { name: String, span: Range<usize>, args: Vec<Arg> },
}

impl Value {
    pub(crate) fn span(&self) -> Range<usize> {
        match self {
            Value::Number { span, .. } | Value::Word { span, .. } | Value::Call { span, .. } => {
                span.clone()
            }
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
    Number(f64),
    Eq,
    Comma,
    Open,
    Close,
}

fn describe(tok: &Tok) -> String {
    match tok {
        Tok::Word(w) => format!("`{w}`"),
        Tok::Number(n) => format!("`{n}`"),
        Tok::Eq => "`=`".into(),
        Tok::Comma => "`,`".into(),
        Tok::Open => "`(`".into(),
        Tok::Close => "`)`".into(),
    }
}

fn tokenize(text: &str) -> Result<Vec<(Tok, Range<usize>)>, SpecError> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        let start = i;
        match c {
            b' ' | b'\t' | b'\n' | b'\r' => {
                i += 1;
                continue;
            }
            b'=' => out.push((Tok::Eq, start..start + 1)),
            b',' => out.push((Tok::Comma, start..start + 1)),
            b'(' => out.push((Tok::Open, start..start + 1)),
            b')' => out.push((Tok::Close, start..start + 1)),
            b'a'..=b'z' | b'A'..=b'Z' | b'_' => {
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                    i += 1;
                }
                out.push((Tok::Word(text[start..i].to_string()), start..i));
                continue;
            }
            b'0'..=b'9' | b'.' | b'-' | b'+' => {
                i += 1;
                while i < bytes.len()
                    && (bytes[i].is_ascii_alphanumeric() || matches!(bytes[i], b'.' | b'_'))
                {
                    // An exponent sign: 1e-3.
                    if matches!(bytes[i], b'e' | b'E')
                        && i + 1 < bytes.len()
                        && matches!(bytes[i + 1], b'-' | b'+')
                    {
                        i += 1;
                    }
                    i += 1;
                }
                let raw = text[start..i].replace('_', "");
                let value: f64 = raw.parse().map_err(|_| {
                    SpecError::new(start..i, format!("`{}` is not a number", &text[start..i]))
                })?;
                out.push((Tok::Number(value), start..i));
                continue;
            }
            _ => {
                let ch = text[start..].chars().next().unwrap_or('?');
                return Err(SpecError::new(
                    start..start + ch.len_utf8(),
                    format!("unexpected character `{ch}`"),
                ));
            }
        }
        i += 1;
    }
    Ok(out)
}

struct Parser<'t> {
    toks: Vec<(Tok, Range<usize>)>,
    pos: usize,
    text: &'t str,
}

impl Parser<'_> {
    fn peek(&self) -> Option<&(Tok, Range<usize>)> {
        self.toks.get(self.pos)
    }

    fn end_span(&self) -> Range<usize> {
        let n = self.text.len();
        n.saturating_sub(1)..n.max(1)
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

    fn expect(&mut self, want: Tok, expected: &str) -> Result<Range<usize>, SpecError> {
        let (tok, span) = self.next(expected)?;
        if tok == want {
            Ok(span)
        } else {
            Err(SpecError::new(
                span,
                format!("expected {expected}, found {}", describe(&tok)),
            ))
        }
    }

    fn key(&mut self) -> Result<(String, Range<usize>), SpecError> {
        match self.next("a key such as `k`, `v` or `sink`")? {
            (Tok::Word(w), span) => Ok((w, span)),
            (tok, span) => Err(SpecError::new(
                span,
                format!("expected a key such as `k`, `v` or `sink`, found {}", describe(&tok)),
            )),
        }
    }

    fn value(&mut self) -> Result<Value, SpecError> {
        match self.next("a value")? {
            (Tok::Number(value), span) => Ok(Value::Number { value, span }),
            (Tok::Word(name), span) => {
                if matches!(self.peek(), Some((Tok::Open, _))) {
                    self.pos += 1;
                    let args = self.args()?;
                    let close = self.expect(Tok::Close, "`)`")?;
                    Ok(Value::Call {
                        name,
                        span: span.start..close.end,
                        args,
                    })
                } else {
                    Ok(Value::Word { name, span })
                }
            }
            (tok, span) => Err(SpecError::new(
                span,
                format!("expected a value, found {}", describe(&tok)),
            )),
        }
    }

    fn args(&mut self) -> Result<Vec<Arg>, SpecError> {
        let mut args = Vec::new();
        loop {
            if matches!(self.peek(), Some((Tok::Close, _)) | None) {
                return Ok(args);
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
                Some((Tok::Close, _)) | None => return Ok(args),
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
    let mut p = Parser { toks, pos: 0, text };
    let mut items = Vec::new();
    while p.peek().is_some() {
        let key = p.key()?;
        p.expect(Tok::Eq, &format!("`=` after `{}`", key.0))?;
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
