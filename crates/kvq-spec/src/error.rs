//! Grammar errors carry a byte span into the scheme text, so the attribute can point at the offending
//! token and the CLI can underline the column.

use std::ops::Range;

/// A scheme text that does not parse or does not describe a valid scheme.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SpecError {
    /// Byte range in the scheme text that the message is about (empty at the end of the text when
    /// something is missing there).
    pub span: Range<usize>,
    pub message: String,
}

impl SpecError {
    pub(crate) fn new(span: Range<usize>, message: impl Into<String>) -> Self {
        Self {
            span,
            message: message.into(),
        }
    }

    /// The message, the line of `text` the span starts on, and carets under the span, for terminals:
    ///
    /// ```text
    /// error: `bits` must be 1, 2, 3, 4 or 8, got `5` (column 9)
    ///   k = int(5, channel), v = fp16
    ///           ^
    /// ```
    ///
    /// Multi-line text (a config file) shows only the offending line and names it.
    pub fn render(&self, text: &str) -> String {
        let start = floor_char_boundary(text, self.span.start);
        let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
        let line_end = text[start..].find('\n').map_or(text.len(), |i| start + i);
        let line = text[line_start..line_end].trim_end_matches('\r');
        let end = floor_char_boundary(text, self.span.end).clamp(start, line_start + line.len());
        let column = text[line_start..start].chars().count();
        let width = text[start..end].chars().count().max(1);
        let place = if line_end < text.len() || line_start > 0 {
            let number = text[..line_start].matches('\n').count() + 1;
            format!("line {number}, column {}", column + 1)
        } else {
            format!("column {}", column + 1)
        };
        // Tabs would shift the carets; one space per character keeps the columns aligned.
        let line: Vec<char> = line
            .chars()
            .map(|c| if c == '\t' { ' ' } else { c })
            .collect();
        let (shown, column, width) = window(&line, column, width);
        format!(
            "error: {} ({place})\n  {shown}\n  {}{}",
            self.message,
            " ".repeat(column),
            "^".repeat(width)
        )
    }
}

/// Characters of a line `render` shows in full; a longer line (generated or hostile text) is cut to
/// a window around the span, so an error stays a few lines whatever the input's size.
const SHOWN_CHARS: usize = 100;

/// The part of `line` to show, and the caret column and width within it.
fn window(line: &[char], column: usize, width: usize) -> (String, usize, usize) {
    if line.len() <= SHOWN_CHARS {
        return (line.iter().collect(), column, width);
    }
    let width = width.min(SHOWN_CHARS / 2);
    let lo = column.saturating_sub(SHOWN_CHARS / 4).min(line.len());
    let hi = (lo + SHOWN_CHARS).max(column + width).min(line.len());
    let mut shown = String::new();
    let mut column = column - lo;
    if lo > 0 {
        shown.push('…');
        column += 1;
    }
    shown.extend(&line[lo..hi]);
    if hi < line.len() {
        shown.push('…');
    }
    (shown, column, width)
}

/// `text` as messages quote it: whole when short, else its start and an ellipsis, so a message about
/// one enormous token stays one line.
pub(crate) fn shown(text: &str) -> std::borrow::Cow<'_, str> {
    const MAX: usize = 40;
    match text.char_indices().nth(MAX) {
        None => text.into(),
        Some((cut, _)) => format!("{}…", &text[..cut]).into(),
    }
}

/// `at` clamped into `text` and moved back onto a character boundary, so slicing cannot panic.
fn floor_char_boundary(text: &str, at: usize) -> usize {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}
