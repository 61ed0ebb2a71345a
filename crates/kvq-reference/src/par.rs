//! Independent jobs over the machine's cores; results come back in job order, so parallel training
//! is exactly as deterministic as serial training.

use crate::RefError;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Runs `f(i)` for `i in 0..n` on up to `threads` threads (0 = all cores).
pub(crate) fn map<R: Send, F: Fn(usize) -> R + Sync>(
    n: usize,
    threads: usize,
    f: F,
) -> Result<Vec<R>, RefError> {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let threads = if threads == 0 { cores } else { threads }.min(n).max(1);
    if threads == 1 {
        return Ok((0..n).map(f).collect());
    }
    let next = AtomicUsize::new(0);
    let out: Mutex<Vec<Option<R>>> = Mutex::new((0..n).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let r = f(i);
                if let Ok(mut o) = out.lock() {
                    o[i] = Some(r);
                }
            });
        }
    });
    let out: Vec<R> = out
        .into_inner()
        .unwrap_or_default()
        .into_iter()
        .flatten()
        .collect();
    if out.len() != n {
        return Err(RefError::Mismatch("a parallel job did not finish".into()));
    }
    Ok(out)
}
