//! The spec accepts every head_dim that is a multiple of 16, but the GPU kernels still split a row
//! into 32-channel units: at `head_dim % 32 != 0` codegen must refuse with a typed error naming why,
//! never render a kernel that reads the wrong channels. Multiples of 32 are not touched by that guard.

use kvq_codegen::{
    cache_kernels, decode_groups, decode_kernels, decode_slow_path, CodegenError, Dtype,
    KernelShape, TuneParams,
};
use kvq_spec::SchemeSpec;

mod common;
use common::SCHEMES;

const REASON: &str =
    "GPU kernels need head_dim a multiple of 32 for now; the CPU reference runs it";

fn is_guard(e: &CodegenError) -> bool {
    matches!(e, CodegenError::Unsupported { what, .. } if what.contains(REASON))
}

#[test]
fn head_dims_80_and_112_are_refused_by_decode_and_cache_codegen() {
    let mut refused = 0;
    for text in SCHEMES {
        let spec = SchemeSpec::parse(text).unwrap();
        for head_dim in [80, 112] {
            if spec.check_shape(head_dim, 1).is_err() {
                // A token group of 32 channels does not divide 80 or 112: the spec says so first.
                continue;
            }
            for (gqa, dtype) in [(1, Dtype::F16), (4, Dtype::Bf16), (8, Dtype::F16)] {
                let shape = KernelShape::new(head_dim, gqa, dtype);
                // The rule functions the runtime asks before rendering stay total at this shape.
                let _ = decode_slow_path(&spec, &shape);
                let _ = decode_groups(&spec, &shape);
                let tune = TuneParams::default_for(&spec, &shape);
                match decode_kernels(&spec, &shape, &tune) {
                    Err(e) if is_guard(&e) => {
                        let CodegenError::Unsupported { family, what } = &e else {
                            unreachable!()
                        };
                        assert_eq!(*family, "decode");
                        assert!(what.contains(&format!("head_dim {head_dim}")), "{e}");
                    }
                    Err(e) => panic!("{text} d{head_dim}: refused for another reason: {e}"),
                    Ok(_) => panic!("{text} d{head_dim}: a decode kernel rendered"),
                }
            }
            match cache_kernels(&spec, head_dim, Dtype::F16) {
                Err(e) if is_guard(&e) => {
                    assert!(
                        e.to_string().starts_with("no cache kernel for head_dim"),
                        "{e}"
                    );
                }
                Err(e) => panic!("{text} d{head_dim}: cache refused for another reason: {e}"),
                Ok(_) => panic!("{text} d{head_dim}: cache kernels rendered"),
            }
            refused += 1;
        }
    }
    // Every scheme but the grouped-token ones reaches the guard at both widths.
    assert!(refused >= 2 * (SCHEMES.len() - 2), "{refused}");
}

#[test]
fn the_guard_message_reads_whole() {
    let spec = SchemeSpec::parse("k = int(2, channel), v = int(2, token), local = 128").unwrap();
    let shape = KernelShape::new(80, 4, Dtype::F16);
    let e = decode_kernels(&spec, &shape, &TuneParams::default_for(&spec, &shape)).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("no decode kernel for head_dim 80: {REASON}")
    );
}

#[test]
fn multiples_of_32_pass_the_guard() {
    for text in SCHEMES {
        let spec = SchemeSpec::parse(text).unwrap();
        for head_dim in [96, 160, 192] {
            if spec.check_shape(head_dim, 1).is_err() {
                continue;
            }
            for (gqa, dtype) in [(1, Dtype::F16), (4, Dtype::Bf16)] {
                let shape = KernelShape::new(head_dim, gqa, dtype);
                let tune = TuneParams::default_for(&spec, &shape);
                if let Err(e) = decode_kernels(&spec, &shape, &tune) {
                    assert!(!is_guard(&e), "{text} d{head_dim}: {e}");
                }
            }
            if let Err(e) = cache_kernels(&spec, head_dim, Dtype::F16) {
                assert!(!is_guard(&e), "{text} d{head_dim}: {e}");
            }
        }
    }
}
