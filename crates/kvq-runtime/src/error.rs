//! The runtime's error type, [`RuntimeError`]: everything from the JIT layer ([`JitError`]:
//! libraries, GPU, NVRTC, cache, module loading, launches) wrapped whole in
//! [`RuntimeError::Jit`], plus what only this crate's work can get wrong (shapes, host memory, the
//! page pool, code generation).
//!
//! A JIT error keeps its message unchanged through the wrapper (`#[error(transparent)]`); match
//! its variant as `RuntimeError::Jit(JitError::NvrtcNotFound { .. })`, or ask
//! [`RuntimeError::jit`]. The constructors callers use for driver results
//! ([`RuntimeError::driver`], [`RuntimeError::launch`], [`RuntimeError::async_failure`]) build
//! the JIT variants as before.

use std::path::PathBuf;

pub use kvq_jit::error::{CompileFailure, JitError, MissingHeader};

/// `Result` with [`RuntimeError`].
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// Everything that can go wrong between a scheme and a finished launch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// A failure of the JIT layer: a CUDA library, the GPU, NVRTC, the module cache, loading a
    /// module or launching a kernel. Its message is the [`JitError`]'s.
    #[error(transparent)]
    Jit(#[from] JitError),

    /// Reading or writing a store in the cache folder (tuning results, quantizer forms) failed
    /// where it could not be ignored.
    #[error("kvq cache: could not {action} {}: {source}", path.display())]
    CacheIo {
        /// What was being done (`create directory`, `write`, …).
        action: &'static str,
        /// Where.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// An argument this crate cannot pass on (e.g. buffers whose shapes disagree with the
    /// kernel's).
    #[error("invalid input: {0}")]
    InvalidInput(String),

    /// Host memory for a request (synthetic data, a tuning workload) is more than the machine has;
    /// refused before any of it was taken.
    #[error(transparent)]
    Memory(#[from] kvq_reference::resources::AllocError),

    /// The page pool cannot hold what a step needs. Nothing was changed.
    #[error(
        "page pool exhausted: this step needs {needed} more page(s) but {free} of {total} are free; \
         nothing was changed (remove finished sequences, or create the cache with more pages)"
    )]
    PoolExhausted {
        /// Pages the step needs.
        needed: usize,
        /// Pages free.
        free: usize,
        /// Pages in the pool.
        total: usize,
    },

    /// A sequence id that was never added or has been removed.
    #[error("unknown sequence {0}: it was never added to this cache or has been removed")]
    UnknownSequence(u32),

    /// Every sequence slot is taken.
    #[error("all {0} sequence slots of this cache are in use: remove a sequence first")]
    NoFreeSlot(usize),

    /// A sequence would grow past the capacity the cache was created with.
    #[error("sequence {id} would grow to {len} tokens, past the cache's capacity of {max} tokens per sequence")]
    CapacityExceeded {
        /// The sequence.
        id: u32,
        /// Its length after the step.
        len: usize,
        /// Tokens per sequence the cache was created for.
        max: usize,
    },

    /// Only the generic CUDA-core decode kernel serves this scheme and shape, and the caller did
    /// not opt in to it (`LoadOptions::allow_slow_path`).
    #[error(
        "decode of `{scheme}` at head_dim {head_dim}, GQA {gqa} would take the generic CUDA-core \
         kernel ({reason}), several times slower than the tensor-core kernel; opt in with \
         LoadOptions::allow_slow_path"
    )]
    SlowPath {
        /// The scheme, as text.
        scheme: String,
        /// The shape's head_dim.
        head_dim: u32,
        /// The shape's query heads a KV head.
        gqa: u32,
        /// Why the tensor-core kernel cannot serve it.
        reason: kvq_codegen::SlowPath,
    },

    /// No kernel could be generated for this scheme and shape.
    #[error(transparent)]
    Codegen(#[from] kvq_codegen::CodegenError),

    /// The CPU reference refused what was handed to it (a cache to upload, a layout to build).
    #[error(transparent)]
    Reference(#[from] kvq_reference::RefError),
}

impl From<kvq_jit::InvalidArch> for RuntimeError {
    fn from(e: kvq_jit::InvalidArch) -> RuntimeError {
        RuntimeError::Jit(e.into())
    }
}

impl RuntimeError {
    /// A failed driver call during `call` ([`JitError::Driver`]).
    pub fn driver(call: impl Into<String>, err: cudarc::driver::DriverError) -> RuntimeError {
        JitError::driver(call, err).into()
    }

    /// A failed launch of `kernel`, as returned by cudarc's `LaunchArgs::launch`
    /// ([`JitError::Launch`]).
    pub fn launch(kernel: impl Into<String>, err: cudarc::driver::DriverError) -> RuntimeError {
        JitError::launch(kernel, err).into()
    }

    /// An error surfaced at a synchronisation after `what` ran (kernel faults are reported there;
    /// [`JitError::Launch`]).
    pub fn async_failure(
        what: impl Into<String>,
        err: cudarc::driver::DriverError,
    ) -> RuntimeError {
        JitError::async_failure(what, err).into()
    }

    /// The JIT layer's error inside, if this is one.
    pub fn jit(&self) -> Option<&JitError> {
        match self {
            RuntimeError::Jit(e) => Some(e),
            _ => None,
        }
    }

    /// Whether this error means NVRTC cannot be used here at all
    /// ([`JitError::is_nvrtc_unusable`]).
    pub fn is_nvrtc_unusable(&self) -> bool {
        self.jit().is_some_and(JitError::is_nvrtc_unusable)
    }

    /// Whether this error means "the machine lacks CUDA" (library, driver or GPU missing), as
    /// opposed to a bug ([`JitError::is_environment`]).
    pub fn is_environment(&self) -> bool {
        self.jit().is_some_and(JitError::is_environment)
    }

    /// A short clause (about 60 characters at most) for a line such as "no usable GPU (…)"
    /// ([`JitError::summary`]); other errors are cut at a word.
    pub fn summary(&self) -> String {
        match self {
            RuntimeError::Jit(e) => e.summary(),
            other => kvq_jit::error::shorten(&other.to_string(), 60),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jit_errors_keep_their_message_and_their_questions() {
        let jit = JitError::NvrtcNotFound {
            primary: "libnvrtc.so.13".into(),
            tried: vec!["libnvrtc.so.13".into()],
        };
        let text = jit.to_string();
        let summary = jit.summary();
        let e = RuntimeError::from(jit);
        assert_eq!(e.to_string(), text);
        assert_eq!(e.summary(), summary);
        assert!(e.is_environment() && e.is_nvrtc_unusable());
        assert!(matches!(
            e,
            RuntimeError::Jit(JitError::NvrtcNotFound { .. })
        ));
        let e = RuntimeError::UnknownSequence(3);
        assert!(!e.is_environment() && e.jit().is_none());
        assert!(
            e.summary().starts_with("unknown sequence 3"),
            "{}",
            e.summary()
        );
    }

    #[test]
    fn an_invalid_arch_reads_the_same_through_both_errors() {
        let bad = "sm_9x".parse::<kvq_jit::Arch>().unwrap_err();
        let text = bad.to_string();
        assert_eq!(RuntimeError::from(bad).to_string(), text);
    }
}
