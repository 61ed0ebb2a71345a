//! The kvq scheme grammar and the typed [`SchemeSpec`] it produces.
//!
//! One parser serves the `#[kvq::scheme(...)]` attribute (at compile time), the `kvq` CLI's
//! `--scheme "..."` and configuration files (at run time), so a scheme reads and fails the same way
//! everywhere.
//!
//! ```
//! use kvq_spec::{SchemeSpec, Axis};
//! let kivi2 = SchemeSpec::parse("k = int(2, channel), v = int(2, token), local = 128").unwrap();
//! assert_eq!(kivi2.k.as_int().unwrap().axis, Axis::Channel);
//! assert_eq!(kivi2.page, 128);
//! // The canonical text parses back to the same scheme.
//! assert_eq!(SchemeSpec::parse(&kivi2.to_string()).unwrap(), kivi2);
//!
//! let text = "k = int(5, channel), v = fp16";
//! let err = SchemeSpec::parse(text).unwrap_err();
//! assert_eq!(err.message, "`bits` must be 1, 2, 3, 4 or 8, got `5`");
//! assert_eq!(err.span, 8..9);
//! assert_eq!(
//!     err.render(text),
//!     "error: `bits` must be 1, 2, 3, 4 or 8, got `5` (column 9)\n  k = int(5, channel), v = fp16\n          ^"
//! );
//! ```
//!
//! The grammar, every key and its range are in `docs/GRAMMAR.md`.

mod error;
mod grammar;
mod shape;
mod types;

pub use error::SpecError;
pub use grammar::syntax::MAX_NESTING;
pub use shape::{ShapeError, HEAD_DIM_MULTIPLE, MAX_BOOSTED_HEAD_DIM};
pub use types::*;

impl SchemeSpec {
    /// Parses and validates scheme text (the same text the attribute takes).
    pub fn parse(text: &str) -> Result<SchemeSpec, SpecError> {
        let items = grammar::syntax::parse_items(text)?;
        grammar::interpret::scheme(items, text.len())
    }
}

impl std::str::FromStr for SchemeSpec {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SchemeSpec::parse(s)
    }
}

/// Codes per 32-bit word at `bits` bits (3-bit codes are a 2-bit plus a 1-bit plane: 32 codes).
pub fn packing_width(bits: u8) -> u32 {
    grammar::interpret::packing_width(bits)
}

/// A KV-cache quantization scheme known at compile time; implemented by `#[kvq::scheme(...)]`.
pub trait Scheme {
    /// The validated scheme.
    const SPEC: SchemeSpec;
    /// The type's name, for tables and kernel names.
    const NAME: &'static str;
    /// The canonical text of [`Self::SPEC`] (what `SPEC.to_string()` gives, and what the type's
    /// documentation shows), available in `const` contexts.
    const TEXT: &'static str;
}
