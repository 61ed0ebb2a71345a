//! The spec accepts every head_dim that is a multiple of 16. The cache kernels serve all of them;
//! the decode kernels still split a row into 32-channel units: at `head_dim % 32 != 0` decode
//! codegen must refuse with a typed error naming why, never render a kernel that reads the wrong
//! channels. Multiples of 32 are not touched by that guard.

use kvq_codegen::{
    cache_kernels, decode_groups, decode_kernels, decode_slow_path, CodegenError, Dtype,
    KernelShape, QuantizerForm, QuantizerForms, TuneParams,
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
fn head_dims_80_and_112_are_refused_by_decode_codegen() {
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
            refused += 1;
        }
    }
    // Every scheme but the grouped-token ones reaches the guard at both widths.
    assert!(refused >= 2 * (SCHEMES.len() - 2), "{refused}");
}

#[test]
fn cache_kernels_serve_every_multiple_of_16_from_64_to_256() {
    let mut rendered = 0;
    for text in SCHEMES {
        let spec = SchemeSpec::parse(text).unwrap();
        for head_dim in (64..=256).step_by(16) {
            if spec.check_shape(head_dim, 1).is_err() {
                continue;
            }
            for dtype in [Dtype::F16, Dtype::Bf16] {
                let k = cache_kernels(&spec, head_dim, dtype)
                    .unwrap_or_else(|e| panic!("{text} d{head_dim} {dtype}: {e}"));
                assert!(k.source.contains(&format!("D = {head_dim};")), "{text}");
                // Every tensor whose layout has a register form gets it by default.
                for (t, form) in [
                    (&spec.k, k.quantizer_forms.k),
                    (&spec.v, k.quantizer_forms.v),
                ] {
                    if t.is_quantized() {
                        let vectorized = QuantizerForm::Vectorized.supports(t, head_dim, spec.page);
                        assert_eq!(
                            form == QuantizerForm::Vectorized,
                            vectorized,
                            "{text} d{head_dim}"
                        );
                    }
                }
                rendered += 1;
            }
        }
    }
    assert!(rendered >= 2 * 13 * (SCHEMES.len() - 2), "{rendered}");
    // Rows of a power of two of 8-channel chunks or not, the register forms take every built-in
    // layout: channel-axis codes, whole-row token groups, Kitty's boost.
    let kitty = SchemeSpec::parse(SCHEMES[3]).unwrap();
    for head_dim in [80, 96, 112, 160, 192] {
        assert_eq!(
            QuantizerForms::default_for(&kitty, head_dim),
            QuantizerForms::both(QuantizerForm::Vectorized),
            "d{head_dim}"
        );
    }
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
