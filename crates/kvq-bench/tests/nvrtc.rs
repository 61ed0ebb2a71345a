//! The bench's own kernels compile with NVRTC, without a GPU. Runs under its own harness: without
//! NVRTC the test shows as ignored, with the reason; `KVQ_REQUIRE_NVRTC=1` (CI) makes that a
//! failure.

use kvq::runtime::nvrtc::{compile, IncludeDirs};
use kvq::runtime::testing::harness::{needs, run};
use kvq::runtime::testing::Need;
use kvq::runtime::{Arch, CompileOptions, Output};
use kvq_bench::read_floor::read_floor_source;

fn main() {
    run(vec![needs(
        Need::Nvrtc,
        "read_kernel_compiles",
        read_kernel_compiles,
    )])
}

fn read_kernel_compiles() {
    let options = CompileOptions::default().include_dirs(IncludeDirs::None);
    for arch in [Arch::SM_80, Arch::SM_90A] {
        let cubin = compile(&read_floor_source(), arch, Output::Cubin, &options).unwrap();
        assert_eq!(
            &cubin.image[..4],
            b"\x7fELF",
            "{arch}: a CUBIN is an ELF image"
        );
    }
}
