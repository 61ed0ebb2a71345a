//! Progress of a tuning session on stderr (indicatif), drawn only for a person at a terminal:
//! logs and CI output stay clean.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A progress bar that is hidden when stderr is not a terminal or when disabled.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A bar of `total` steps labelled `prefix`.
    pub fn new(total: u64, prefix: String, enabled: bool) -> Progress {
        let target = if enabled && std::io::stderr().is_terminal() {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(Some(total), target);
        if let Ok(style) =
            ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(prefix);
        Progress { bar }
    }

    /// Names the current phase.
    pub fn phase(&self, message: impl Into<String>) {
        self.bar.set_message(message.into());
    }

    /// Advances by `n` steps.
    pub fn advance(&self, n: u64) {
        self.bar.inc(n);
    }

    /// Changes the total (a phase that needed fewer steps than planned).
    pub fn set_total(&self, total: u64) {
        self.bar.set_length(total);
    }

    /// Clears the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
