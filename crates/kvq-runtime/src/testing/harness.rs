//! The harness of kvq's test files that need a GPU, NVRTC or a C compiler (enabled by the
//! `testing` feature; each such file is a `[[test]]` with `harness = false` whose `main` calls
//! [`run`]). A test whose need is missing here shows in `cargo test`'s summary as
//! `ignored (<reason>)` instead of passing unseen, and fails with the reason where a
//! `KVQ_REQUIRE_*` flag says it must run (see [`Need::gate`] and [`Skip::gate`]).
//!
//! The command line is libtest's (name filters, `--exact`, `--list`, `--ignored`,
//! `--nocapture`, `--test-threads`), so the usual `cargo test … -- <filter>` works.
//!
//! ```no_run
//! use kvq_runtime::testing::harness::{checked, needs, plain, run};
//! use kvq_runtime::testing::{c_compiler, Need, Skip};
//!
//! fn parses() { assert_eq!("1".parse::<u32>().unwrap(), 1) }
//! fn compiles() { /* runs only where NVRTC loads */ }
//! fn builds_c() -> Result<(), Skip> {
//!     let _cc = c_compiler()?; // ignored without one, a failure under KVQ_REQUIRE_CC=1
//!     Ok(())
//! }
//!
//! fn main() {
//!     run(vec![
//!         plain("parses", parses),
//!         needs(Need::Nvrtc, "compiles", compiles),
//!         checked("builds_c", builds_c),
//!     ])
//! }
//! ```

use std::sync::OnceLock;

pub use libtest_mimic::Trial;
use libtest_mimic::{Arguments, Completion, Failed};

use super::{Gate, Need, Skip};

/// Runs `trials` under libtest's command line and exits with its status (101 when a test
/// failed).
pub fn run(trials: Vec<Trial>) -> ! {
    libtest_mimic::run(&Arguments::from_args(), trials).exit()
}

/// A test that needs nothing but the CPU.
pub fn plain(name: &str, test: fn()) -> Trial {
    Trial::test(name, move || {
        test();
        Ok(())
    })
}

/// A test that needs `need`: runs where it is here, shows as ignored with the reason where it is
/// not, and fails with the reason where a `KVQ_REQUIRE_*` flag says it must run.
pub fn needs(need: Need, name: &str, test: fn()) -> Trial {
    Trial::ignorable_test(name, move || match gate(need) {
        Gate::Run => {
            test();
            Ok(Completion::Completed)
        }
        other => outcome(other),
    })
}

/// Every test of `tests` (name, body) as [`needs`] `need`.
pub fn all_need(need: Need, tests: &[(&'static str, fn())]) -> Vec<Trial> {
    tests
        .iter()
        .map(|&(name, test)| needs(need, name, test))
        .collect()
}

/// A test that finds out itself whether it can run: `Err(Skip)` shows as ignored with the
/// reason, or fails where one of the skip's flags is set.
pub fn checked(name: &str, test: fn() -> Result<(), Skip>) -> Trial {
    Trial::ignorable_test(name, move || match test() {
        Ok(()) => Ok(Completion::Completed),
        Err(skip) => outcome(&skip.gate()),
    })
}

/// The machine's [`Gate`] for `need`, looked up once per process (opening the device is slow,
/// and every test of a file asks).
pub fn gate(need: Need) -> &'static Gate {
    static GPU: OnceLock<Gate> = OnceLock::new();
    static NVRTC: OnceLock<Gate> = OnceLock::new();
    match need {
        Need::Gpu => GPU.get_or_init(|| need.gate()),
        Need::Nvrtc => NVRTC.get_or_init(|| need.gate()),
    }
}

/// What libtest-mimic reports for a test that did not run because of `gate`.
fn outcome(gate: &Gate) -> Result<Completion, Failed> {
    match gate {
        Gate::Run => Ok(Completion::Completed),
        Gate::Skip(reason) => Ok(Completion::ignored_with(reason)),
        Gate::Fail(reason) => Err(reason.into()),
    }
}
