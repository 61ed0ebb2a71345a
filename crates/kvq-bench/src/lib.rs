//! kvq's decode benchmarks: the library behind `kvq bench`.
//!
//! `kvq bench` (kvq-cli) measures every GPU scheme over a grid of batch sizes and context lengths
//! with [`run`] and writes a table (markdown + JSON) and a latency plot (SVG) with [`output`];
//! `benches/decode.rs` is a criterion bench of a few shapes on the same workload. Both time with
//! the one GPU timer ([`kvq::runtime::GpuTimer`]: CUDA events, runs queued behind a spin kernel)
//! on rotating copies of the batch (bigger than L2 together), exactly as the autotuner does, so a
//! table and a tuning result measure the same thing.
//!
//! * [`grid`]: schemes and shapes, parsed from flags;
//! * [`workload`]: random K/V once per context length, every scheme's reference cache in parallel;
//! * [`bytes`]: the bytes a decode step must move (the effective-bandwidth numerator);
//! * [`copy`]: the device-to-device copy bandwidth of the same run;
//! * [`read_floor`]: the least time one launch takes to read a step's bytes (its floor at small
//!   batches, where launching and ramping up cost as much as the bytes);
//! * [`runner`]: the measurement loop; [`report`] and [`plot`]: its outputs; [`output`]: their
//!   files, and drawing them again from saved JSON.

#![warn(missing_docs)]

pub mod bytes;
pub mod copy;
pub mod date;
pub mod error;
pub mod grid;
pub mod output;
pub mod plot;
pub mod read_floor;
pub mod report;
pub mod runner;
pub mod workload;

pub use error::{BenchError, Result};
pub use grid::BenchConfig;
pub use report::BenchResults;
pub use runner::run;
