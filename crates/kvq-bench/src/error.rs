//! The bench's error type: the runtime's errors plus usage and output problems.

use std::path::PathBuf;

use kvq::runtime::RuntimeError;

/// Everything that can stop a benchmark run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A GPU, JIT or tuner failure.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// A flag value that does not parse or select anything.
    #[error("{0}")]
    Usage(String),
    /// The CPU reference refused an input.
    #[error("CPU reference: {0}")]
    Reference(String),
    /// A result file could not be written.
    #[error("could not write {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A results file could not be read back (`kvq bench --replot`).
    #[error("could not read {}: {why}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// A size the machine cannot give (a context or batch past its memory).
    #[error(transparent)]
    Memory(#[from] kvq::reference::resources::AllocError),
    /// The plot could not be drawn.
    #[error("plot: {0}")]
    Plot(String),
}

impl From<kvq::runtime::JitError> for BenchError {
    fn from(e: kvq::runtime::JitError) -> BenchError {
        BenchError::Runtime(e.into())
    }
}

/// `Result` with [`BenchError`].
pub type Result<T, E = BenchError> = std::result::Result<T, E>;
