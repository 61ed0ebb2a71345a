//! Grammar errors carry a byte span into the scheme text, so the attribute can point at the offending
//! token and the CLI can underline the column.

use std::ops::Range;

/// A scheme text that does not parse or does not describe a valid scheme.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SpecError {
    /// Byte range in the scheme text that the message is about.
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

    /// The message followed by the text and a caret line under the span, for terminals.
    pub fn render(&self, text: &str) -> String {
        let start = self.span.start.min(text.len());
        let end = self.span.end.clamp(start, text.len());
        let column = text[..start].chars().count();
        let width = text[start..end].chars().count().max(1);
        format!(
            "error: {} (column {})\n  {}\n  {}{}",
            self.message,
            column + 1,
            text,
            " ".repeat(column),
            "^".repeat(width)
        )
    }
}
