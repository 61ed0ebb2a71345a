//! The harness of this crate's GPU test files, under libtest's command line: each test shows as
//! `ignored (reason)` without a GPU and fails with the reason under `KVQ_REQUIRE_GPU=1`; the GPU
//! is looked for once, by the first test that runs.

use std::sync::{Arc, OnceLock};

use kvq_runtime::testing::{Gate, Need};

/// Runs `tests` (name, body), each gated on a GPU, and exits with libtest's status.
pub fn run_gpu_tests(tests: &[(&'static str, fn())]) -> ! {
    let gate = Arc::new(OnceLock::new());
    let trials = tests
        .iter()
        .map(|&(name, test)| {
            let gate = Arc::clone(&gate);
            libtest_mimic::Trial::ignorable_test(name, move || {
                match gate.get_or_init(|| Need::Gpu.gate()) {
                    Gate::Run => {
                        test();
                        Ok(libtest_mimic::Completion::Completed)
                    }
                    Gate::Skip(reason) => Ok(libtest_mimic::Completion::ignored_with(reason)),
                    Gate::Fail(reason) => Err(reason.into()),
                }
            })
        })
        .collect();
    libtest_mimic::run(&libtest_mimic::Arguments::from_args(), trials).exit()
}
