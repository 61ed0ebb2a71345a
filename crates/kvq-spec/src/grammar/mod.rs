//! The scheme grammar, in two layers: [`syntax`] turns text into a small untyped tree of keys, calls
//! and values (with byte spans); [`interpret`] checks that tree against what kvq supports and builds a
//! [`SchemeSpec`](crate::SchemeSpec). [`print`] writes the canonical text back. Keeping the syntax
//! this small (keys, words, numbers, calls) lets the attribute reuse it unchanged: Rust tokens
//! flatten to exactly this text. `docs/GRAMMAR.md` lists every key.
//!
//! ```text
//! scheme := item ("," item)* ","?
//! item   := KEY "=" value
//! value  := NUMBER | WORD | WORD "(" (arg ("," arg)* ","?)? ")"
//! arg    := value | KEY "=" value
//! ```

pub(crate) mod interpret;
pub(crate) mod print;
pub(crate) mod syntax;
