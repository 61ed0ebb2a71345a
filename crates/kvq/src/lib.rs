//! kvq: quantized KV-cache attention for LLM inference engines.
//!
//! Declare a scheme in one attribute, checked at compile time:
//!
//! ```
//! #[kvq::scheme(k = int(2, channel, boost = boost(4, ratio = 0.125)), v = int(2, token, local = 128), sink = 32)]
//! pub struct MyKitty;
//!
//! use kvq::Scheme;
//! assert_eq!(MyKitty::SPEC, kvq::schemes::Kitty::SPEC);
//! ```
//!
//! The same text parses at run time, for schemes from a CLI flag or a config file:
//!
//! ```
//! let spec: kvq::SchemeSpec = "k = int(4, channel), v = int(4, token)".parse().unwrap();
//! assert_eq!(spec.page, 128);
//! ```
//!
//! See `docs/GRAMMAR.md` for the grammar and `docs/LAYOUT.md` for the cache's byte layout.

// Lets `::kvq::...` paths emitted by the attribute resolve inside this crate too.
extern crate self as kvq;

pub use kvq_macros::scheme;
pub use kvq_spec::*;

// The member crates are inlined so that `cargo doc -p kvq` documents them as modules of the facade
// (a bare `pub use` line otherwise, with nothing behind it).
#[doc(inline)]
pub use kvq_codegen as codegen;
#[doc(inline)]
pub use kvq_reference as reference;
#[doc(inline)]
pub use kvq_runtime as runtime;
#[doc(inline)]
pub use kvq_runtime::kvq_jit as jit;

pub mod evaluate;
pub mod schemes;
