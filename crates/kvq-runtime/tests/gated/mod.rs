//! The harness of this crate's GPU test files: each test shows as `ignored (reason)` without a
//! GPU and fails with the reason under `KVQ_REQUIRE_GPU=1`; the GPU is looked for once.

use kvq_runtime::testing::harness::{all_need, run};
use kvq_runtime::testing::Need;

/// Runs `tests` (name, body), each gated on a GPU, and exits with libtest's status.
pub fn run_gpu_tests(tests: &[(&'static str, fn())]) -> ! {
    run(all_need(Need::Gpu, tests))
}
