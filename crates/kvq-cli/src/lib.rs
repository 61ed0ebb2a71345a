//! The `kvq` command line (binary in `main.rs`): the subcommands as library functions, so tests can
//! call them directly as well as through the built binary.

pub mod cli;
pub mod demo;
pub mod error;
pub mod eval;
pub mod gen;
pub mod gpu;
mod gpu_codebook;
mod gpu_xquant;
pub mod info;
pub mod run;
pub mod sample;
pub mod sample_codebook;
pub mod scheme;
pub mod table;
mod tune_xquant;

pub use error::{CliError, Result};
