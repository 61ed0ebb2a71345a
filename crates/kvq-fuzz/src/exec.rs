//! Runs one input of a target in isolation: on a worker thread with a small stack, under
//! `catch_unwind`, with a time limit.
//!
//! A panic is caught and reported with its message and source location. A stack overflow cannot
//! be caught (the process aborts); the small stack makes deep recursion overflow at depths a
//! server's default 2–8 MiB stacks would also meet with somewhat longer input, so such a bug is
//! found rather than hidden by a roomy test thread. The supervisor in `crate::fuzz` turns an
//! abort of a child process into a finding. An input that runs past the limit is a hang: the
//! worker is abandoned (a thread cannot be killed) and a fresh one serves the next input.

use std::cell::RefCell;
use std::fmt;
use std::panic::{self, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Once;
use std::thread;
use std::time::Duration;

/// The name of the threads that run inputs; the panic hook stays quiet on them only.
pub const WORKER_THREAD: &str = "kvq-fuzz-worker";

/// Stack of a worker thread: 1 MiB (a quarter to an eighth of what servers give a thread).
pub const DEFAULT_STACK: usize = 1 << 20;

/// What went wrong with one input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// The code under test panicked.
    Panic,
    /// The input ran past the time limit.
    Hang,
    /// The process died (stack overflow, failed allocation, abort): seen by the supervisor.
    Abort,
    /// No panic, but a property the target checks failed (round trip, message, consistency).
    Oracle,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Panic => "panic",
            Kind::Hang => "hang",
            Kind::Abort => "abort",
            Kind::Oracle => "oracle",
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One finding: its kind, its message and, for panics, where the panic was raised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub kind: Kind,
    pub message: String,
    pub location: Option<String>,
}

impl Finding {
    pub fn oracle(message: impl Into<String>) -> Self {
        Self {
            kind: Kind::Oracle,
            message: message.into(),
            location: None,
        }
    }

    /// What makes two findings the same bug: the kind, the panic location, and the message
    /// with its numbers taken out (the same overflow at another head_dim is the same bug).
    pub fn signature(&self) -> String {
        let mut msg: String = self
            .message
            .chars()
            .map(|c| match c {
                c if c.is_ascii_digit() => '#',
                c if c.is_control() => ' ',
                c => c,
            })
            .collect();
        msg = squeeze(&msg, '#');
        // Oracle messages name their property first; the rest quotes the input.
        let msg: String = match self.kind {
            Kind::Oracle => msg.split(':').next().unwrap_or("").to_string(),
            _ => msg.chars().take(80).collect(),
        };
        format!(
            "{} @ {} | {}",
            self.kind,
            self.location.as_deref().unwrap_or("-"),
            msg
        )
    }
}

fn squeeze(s: &str, c: char) -> String {
    let mut out = String::with_capacity(s.len());
    let mut last = None;
    for ch in s.chars() {
        if ch == c && last == Some(c) {
            continue;
        }
        out.push(ch);
        last = Some(ch);
    }
    out
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)?;
        if let Some(l) = &self.location {
            write!(f, " (at {l})")?;
        }
        Ok(())
    }
}

/// A target's check of one input: `Err` is an oracle finding; a panic is caught around it.
pub type Check = fn(&[u8]) -> Result<(), String>;

thread_local! {
    static LAST_PANIC: RefCell<Option<(String, Option<String>)>> = const { RefCell::new(None) };
}

/// Installs (once) a panic hook that records a worker's panic for [`Executor`] instead of
/// printing it; panics on other threads go to the hook that was there before.
pub fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if thread::current().name() != Some(WORKER_THREAD) {
                previous(info);
                return;
            }
            let payload = info.payload();
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(a panic without a message)".to_string());
            let location = info
                .location()
                .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()));
            LAST_PANIC.with(|p| *p.borrow_mut() = Some((message, location)));
        }));
    });
}

type Job = (Check, Vec<u8>);
type Outcome = Result<(), Finding>;

struct Worker {
    jobs: Sender<Job>,
    outcomes: Receiver<Outcome>,
}

fn spawn_worker(stack: usize) -> std::io::Result<Worker> {
    let (jobs, job_rx) = mpsc::channel::<Job>();
    let (out_tx, outcomes) = mpsc::channel::<Outcome>();
    thread::Builder::new()
        .name(WORKER_THREAD.into())
        .stack_size(stack)
        .spawn(move || {
            for (check, input) in job_rx {
                LAST_PANIC.with(|p| *p.borrow_mut() = None);
                let outcome = match panic::catch_unwind(AssertUnwindSafe(|| check(&input))) {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(message)) => Err(Finding::oracle(message)),
                    Err(_) => {
                        let (message, location) = LAST_PANIC
                            .with(|p| p.borrow_mut().take())
                            .unwrap_or_else(|| ("(panic not recorded)".into(), None));
                        Err(Finding {
                            kind: Kind::Panic,
                            message,
                            location,
                        })
                    }
                };
                if out_tx.send(outcome).is_err() {
                    break;
                }
            }
        })?;
    Ok(Worker { jobs, outcomes })
}

/// Runs inputs one at a time on a worker thread; see the module docs.
pub struct Executor {
    worker: Option<Worker>,
    stack: usize,
    limit: Duration,
}

impl Executor {
    pub fn new(stack: usize, limit: Duration) -> Self {
        install_panic_hook();
        Self {
            worker: None,
            stack,
            limit,
        }
    }

    /// Runs `check` on `input`: `Ok` when it returned `Ok`, else the finding.
    pub fn run(&mut self, check: Check, input: &[u8]) -> Result<(), Finding> {
        let worker = match self.worker.take() {
            Some(w) => w,
            None => spawn_worker(self.stack).map_err(|e| Finding {
                kind: Kind::Abort,
                message: format!("cannot start a worker thread: {e}"),
                location: None,
            })?,
        };
        if worker.jobs.send((check, input.to_vec())).is_err() {
            return Err(Finding {
                kind: Kind::Abort,
                message: "the worker thread is gone".into(),
                location: None,
            });
        }
        match worker.outcomes.recv_timeout(self.limit) {
            Ok(outcome) => {
                self.worker = Some(worker);
                outcome
            }
            // The worker is left to finish (or not) on its own; the next input gets a new one.
            Err(RecvTimeoutError::Timeout) => Err(Finding {
                kind: Kind::Hang,
                message: format!("one input ran longer than {:?}", self.limit),
                location: None,
            }),
            Err(RecvTimeoutError::Disconnected) => Err(Finding {
                kind: Kind::Abort,
                message: "the worker thread died without an outcome".into(),
                location: None,
            }),
        }
    }
}

/// Escapes bytes for a terminal: printable ASCII as is, `\n`, `\t`, `\\`, other bytes `\xNN`.
/// Long inputs keep their first and last `keep / 2` bytes.
pub fn escape(input: &[u8], keep: usize) -> String {
    let one = |out: &mut String, b: u8| match b {
        b'\n' => out.push_str("\\n"),
        b'\t' => out.push_str("\\t"),
        b'\\' => out.push_str("\\\\"),
        0x20..=0x7e => out.push(b as char),
        _ => out.push_str(&format!("\\x{b:02x}")),
    };
    let mut out = String::new();
    if input.len() <= keep {
        input.iter().for_each(|&b| one(&mut out, b));
    } else {
        let half = keep / 2;
        input[..half].iter().for_each(|&b| one(&mut out, b));
        out.push_str(&format!("[… {} bytes …]", input.len() - 2 * half));
        input[input.len() - half..]
            .iter()
            .for_each(|&b| one(&mut out, b));
    }
    out
}
