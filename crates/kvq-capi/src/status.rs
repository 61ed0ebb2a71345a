//! What every call returns, and the message that goes with a failure.
//!
//! A call that fails returns a status other than [`KvqStatus::Ok`] and leaves a message for the
//! calling thread ([`kvq_last_error_message`]); a call that succeeds leaves the previous message as
//! it was. Nothing unwinds across the ABI: a panic inside kvq (a bug) becomes
//! [`KvqStatus::Internal`] with the panic's text.

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use kvq::jit::JitError;
use kvq::runtime::RuntimeError;

/// Status of a call. Values are stable; new ones may be added.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvqStatus {
    /// The call did what it says.
    Ok = 0,
    /// An argument is null, out of range or inconsistent with another (the message names it).
    InvalidArgument = 1,
    /// The scheme text does not parse or validate (the message points at the offending column).
    InvalidScheme = 2,
    /// The scheme is valid but this surface does not run it (XQuant: its GPU decode is not on the
    /// engine surface yet).
    UnsupportedScheme = 3,
    /// The scheme cannot serve this shape on the fast kernels (the message says why); kvq never
    /// falls back to a slow kernel silently.
    UnsupportedShape = 4,
    /// The CUDA driver or the GPU failed, or is missing (no libcuda, no GPU, a failed launch, a
    /// stream of another context): the message names the call and the fix.
    Cuda = 5,
    /// NVRTC is missing or failed to compile a kernel, or the kernel cache could not be used.
    Compile = 6,
    /// A bug in kvq: please report the message.
    Internal = 99,
}

/// A failure: a status and its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// What kind of failure.
    pub status: KvqStatus,
    /// What went wrong, for a person.
    pub message: String,
}

impl Failure {
    /// A failure of `status` saying `message`.
    pub fn new(status: KvqStatus, message: impl Into<String>) -> Self {
        Failure {
            status,
            message: message.into(),
        }
    }

    /// [`KvqStatus::InvalidArgument`].
    pub fn argument(message: impl Into<String>) -> Self {
        Failure::new(KvqStatus::InvalidArgument, message)
    }

    /// A runtime error as the status of its kind, with its message.
    pub fn runtime(e: RuntimeError) -> Self {
        let status = match &e {
            RuntimeError::Jit(j) => jit_status(j),
            RuntimeError::InvalidInput(_) => KvqStatus::InvalidArgument,
            RuntimeError::SlowPath { .. } => KvqStatus::UnsupportedShape,
            RuntimeError::CacheIo { .. } => KvqStatus::Compile,
            _ => KvqStatus::Internal,
        };
        Failure::new(status, e.to_string())
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.status, self.message)
    }
}

/// A failure is an error to Rust callers of the crate (`?` into `Box<dyn Error>`).
impl std::error::Error for Failure {}

/// The status of a JIT-layer error: the driver's and the GPU's, or NVRTC's and the cache's.
fn jit_status(e: &JitError) -> KvqStatus {
    match e {
        JitError::NvrtcNotFound { .. }
        | JitError::NvrtcVersionMismatch { .. }
        | JitError::Nvrtc { .. }
        | JitError::Compile(_)
        | JitError::MissingHeader(_)
        | JitError::UnsupportedArch { .. }
        | JitError::InvalidArch(_)
        | JitError::CacheIo { .. }
        | JitError::NoCacheDir => KvqStatus::Compile,
        JitError::InvalidInput(_) => KvqStatus::InvalidArgument,
        _ => KvqStatus::Cuda,
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `message` as this thread's last error (interior NULs become spaces, so no message is
/// lost to truncation).
fn set_last_error(message: &str) {
    let bytes: Vec<u8> = message
        .bytes()
        .map(|b| if b == 0 { b' ' } else { b })
        .collect();
    let text = CString::new(bytes).unwrap_or_default();
    LAST_ERROR.with(|slot| *slot.borrow_mut() = text);
}

/// Runs one ABI call's body: its failure or panic becomes a status and this thread's message.
pub fn call(body: impl FnOnce() -> Result<(), Failure>) -> KvqStatus {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => KvqStatus::Ok,
        Ok(Err(failure)) => {
            set_last_error(&failure.message);
            failure.status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            set_last_error(&format!("internal error in kvq (please report): {what}"));
            KvqStatus::Internal
        }
    }
}

/// The message of the calling thread's last failed call (an empty string before any failure).
/// The pointer stays valid until the thread's next failing call into kvq.
#[no_mangle]
pub extern "C" fn kvq_last_error_message() -> *const c_char {
    LAST_ERROR.with(|slot| slot.borrow().as_ptr())
}

/// The name of a status value, e.g. `"KVQ_STATUS_INVALID_SCHEME"`, or `"KVQ_STATUS_UNKNOWN"` for a
/// value that is no status (static storage). Takes an `int` so that any value is safe to pass.
#[no_mangle]
pub extern "C" fn kvq_status_name(status: i32) -> *const c_char {
    let name: &'static CStr = match status {
        0 => c"KVQ_STATUS_OK",
        1 => c"KVQ_STATUS_INVALID_ARGUMENT",
        2 => c"KVQ_STATUS_INVALID_SCHEME",
        3 => c"KVQ_STATUS_UNSUPPORTED_SCHEME",
        4 => c"KVQ_STATUS_UNSUPPORTED_SHAPE",
        5 => c"KVQ_STATUS_CUDA",
        6 => c"KVQ_STATUS_COMPILE",
        99 => c"KVQ_STATUS_INTERNAL",
        _ => c"KVQ_STATUS_UNKNOWN",
    };
    name.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        unsafe { CStr::from_ptr(kvq_last_error_message()) }
            .to_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn a_failure_sets_the_message_and_a_success_keeps_it() {
        let status = call(|| Err(Failure::argument("limits is null")));
        assert_eq!(status, KvqStatus::InvalidArgument);
        assert_eq!(last(), "limits is null");
        assert_eq!(call(|| Ok(())), KvqStatus::Ok);
        assert_eq!(last(), "limits is null");
    }

    #[test]
    fn a_panic_is_an_internal_status_with_its_text() {
        let status = call(|| panic!("index 7 out of range"));
        assert_eq!(status, KvqStatus::Internal);
        assert!(last().contains("index 7 out of range"), "{}", last());
    }

    #[test]
    fn interior_nuls_do_not_cut_the_message() {
        call(|| Err(Failure::argument("a\0b")));
        assert_eq!(last(), "a b");
    }

    #[test]
    fn messages_are_per_thread() {
        call(|| Err(Failure::argument("main thread")));
        std::thread::spawn(|| {
            assert_eq!(last(), "");
            call(|| Err(Failure::argument("other thread")));
            assert_eq!(last(), "other thread");
        })
        .join()
        .unwrap();
        assert_eq!(last(), "main thread");
    }

    #[test]
    fn status_names_match_the_header() {
        let name = |s: KvqStatus| {
            unsafe { CStr::from_ptr(kvq_status_name(s as i32)) }
                .to_str()
                .unwrap()
        };
        assert_eq!(name(KvqStatus::Ok), "KVQ_STATUS_OK");
        assert_eq!(
            name(KvqStatus::UnsupportedShape),
            "KVQ_STATUS_UNSUPPORTED_SHAPE"
        );
        let header = include_str!("../include/kvq.h");
        for s in [
            KvqStatus::Ok,
            KvqStatus::InvalidArgument,
            KvqStatus::InvalidScheme,
            KvqStatus::UnsupportedScheme,
            KvqStatus::UnsupportedShape,
            KvqStatus::Cuda,
            KvqStatus::Compile,
            KvqStatus::Internal,
        ] {
            let n = name(s);
            assert!(
                header.contains(&format!("{n} = {}", s as i32)),
                "{n} not in kvq.h"
            );
        }
        let unknown = unsafe { CStr::from_ptr(kvq_status_name(42)) };
        assert_eq!(unknown.to_str().unwrap(), "KVQ_STATUS_UNKNOWN");
    }
}
