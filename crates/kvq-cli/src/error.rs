//! The CLI's one error type: every failure is a value with a readable message and an exit code, so
//! scripts can tell a mistyped command (2) from a missing GPU (3) from a failure while running (1).

use std::path::PathBuf;

use kvq::codegen::CodegenError;
use kvq::evaluate::EvalError;
use kvq::runtime::{JitError, RuntimeError};
use kvq_bench::BenchError;

/// Exit status of a failure the user must fix in the command or its inputs.
pub const EXIT_USAGE: u8 = 2;
/// Exit status of a command that needs a GPU on a machine without a usable one.
pub const EXIT_NO_GPU: u8 = 3;
/// Exit status of every other failure (I/O, a driver or kernel failure, a bug).
pub const EXIT_FAILURE: u8 = 1;

/// Everything a `kvq` command can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A flag value that does not parse or does not fit the others.
    #[error("{0}")]
    Usage(String),

    /// `--scheme` is neither a built-in name nor scheme text.
    #[error(
        "unknown scheme `{name}`: built-ins are {}; or pass scheme text, e.g. \
         --scheme \"k = int(2, channel), v = int(2, token)\" (docs/GRAMMAR.md)",
        builtins.join(", ")
    )]
    UnknownScheme {
        /// What was given.
        name: String,
        /// Every built-in name.
        builtins: Vec<String>,
    },

    /// Scheme text that does not parse; `rendered` is `SpecError::render` (caret under the column).
    #[error("invalid scheme text\n{rendered}")]
    Grammar {
        /// The text given.
        text: String,
        /// The message, the line and the carets.
        rendered: String,
    },

    /// A valid scheme this command cannot handle (e.g. no GPU kernel for its family yet).
    #[error("{0}")]
    Unsupported(String),

    /// An input file that is missing or unreadable, or whose contents do not fit.
    #[error("{}: {why}", path.display())]
    Input {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming what was expected.
        why: String,
    },

    /// A file or folder could not be written.
    #[error("could not write {}: {source}", path.display())]
    Write {
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },

    /// The command needs a GPU and none is usable (the runtime's error says why).
    #[error("this command needs a GPU: {0}")]
    NoGpu(RuntimeError),

    /// A runtime failure: compilation, a driver call, a launch.
    #[error(transparent)]
    Runtime(RuntimeError),

    /// Source generation refused the scheme or shape.
    #[error(transparent)]
    Codegen(#[from] CodegenError),

    /// The CPU reference refused the scheme or data.
    #[error(transparent)]
    Eval(#[from] EvalError),

    /// The bench runner failed.
    #[error(transparent)]
    Bench(BenchError),
}

impl From<RuntimeError> for CliError {
    /// Environment problems (no driver, no GPU, no NVRTC) are told apart from failures, so the
    /// exit code says which.
    fn from(e: RuntimeError) -> Self {
        if e.is_environment() {
            CliError::NoGpu(e)
        } else {
            CliError::Runtime(e)
        }
    }
}

impl From<BenchError> for CliError {
    fn from(e: BenchError) -> Self {
        match e {
            BenchError::Runtime(r) => r.into(),
            BenchError::Usage(m) => CliError::Usage(m),
            other => CliError::Bench(other),
        }
    }
}

impl CliError {
    /// The process exit status for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_)
            | CliError::UnknownScheme { .. }
            | CliError::Grammar { .. }
            | CliError::Unsupported(_)
            | CliError::Input { .. } => EXIT_USAGE,
            CliError::Codegen(CodegenError::Unsupported { .. })
            | CliError::Codegen(CodegenError::Shape(_))
            | CliError::Codegen(CodegenError::SchemeShape(_)) => EXIT_USAGE,
            CliError::Eval(EvalError::Unsupported(_))
            | CliError::Eval(EvalError::Workload(_))
            | CliError::Eval(EvalError::Reference(_)) => EXIT_USAGE,
            CliError::Runtime(RuntimeError::InvalidInput(_))
            | CliError::Runtime(RuntimeError::Jit(JitError::InvalidInput(_)))
            | CliError::Runtime(RuntimeError::Memory(_)) => EXIT_USAGE,
            CliError::NoGpu(_) => EXIT_NO_GPU,
            _ => EXIT_FAILURE,
        }
    }

    /// What to print on stderr: grammar errors as rendered (they start with `error:` and point at
    /// the column), everything else as `error: message` plus its chain of causes.
    pub fn report(&self) -> String {
        if let CliError::Grammar { rendered, .. } = self {
            return rendered.clone();
        }
        let mut s = format!("error: {self}");
        let mut source = std::error::Error::source(self);
        while let Some(cause) = source {
            // Messages that already quote their cause (I/O errors) are not repeated.
            let text = cause.to_string();
            if !s.contains(&text) {
                s.push_str(&format!("\n  caused by: {text}"));
            }
            source = cause.source();
        }
        s
    }
}

/// `Result` with [`CliError`].
pub type Result<T, E = CliError> = std::result::Result<T, E>;
