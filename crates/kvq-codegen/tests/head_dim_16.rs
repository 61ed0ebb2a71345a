//! The spec accepts every head_dim that is a multiple of 16, and so do the GPU kernels: the cache
//! kernels, and the decode kernels, which read a row of a size other than a power of two as slabs
//! (docs/LAYOUT.md §9) on the tensor-core kernel wherever they take it at head_dim 128.

use kvq_codegen::{
    cache_kernels, decode_groups, decode_kernels, decode_slow_path, Dtype, KernelShape,
    QuantizerForm, QuantizerForms, TuneParams,
};
use kvq_spec::SchemeSpec;

mod common;
use common::SCHEMES;

/// A tensor-core unit's slabs of one side (`K` or `V`): (`DVK` or `DVV`, the `KVQ_KSLAB0..3` or
/// `KVQ_VSLAB0..3` sizes).
fn slabs_of(source: &str, side: char) -> (u32, Vec<u32>) {
    let value = |line: &str, name: &str| -> u32 {
        let at = line.find(&format!("{name} = ")).expect(name) + name.len() + 3;
        line[at..]
            .split([',', ';'])
            .next()
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let dim = format!("DV{side}");
    let dim_line = source
        .lines()
        .find(|l| l.contains(&format!("{dim} = ")))
        .expect("DVK, DVV");
    let slab_line = source
        .lines()
        .find(|l| l.contains(&format!("KVQ_{side}SLAB0 = ")))
        .expect("slabs");
    let slabs = (0..4)
        .map(|i| value(slab_line, &format!("KVQ_{side}SLAB{i}")))
        .filter(|&s| s > 0)
        .collect();
    (value(dim_line, &dim), slabs)
}

#[test]
fn decode_kernels_serve_every_multiple_of_16_from_64_to_256() {
    let mut rendered = 0;
    for text in SCHEMES {
        let spec = SchemeSpec::parse(text).unwrap();
        let d128 = KernelShape::new(128, 4, Dtype::F16);
        let fast_at_128 = decode_slow_path(&spec, &d128).is_none();
        let low_bit_v = matches!(spec.v, kvq_spec::TensorQuant::Int(q) if q.bits <= 2);
        for head_dim in (64..=256).step_by(16) {
            if spec.check_shape(head_dim, 1).is_err() {
                // A token group of 32 channels does not divide 80 or 112: the spec says so first.
                continue;
            }
            for (gqa, dtype) in [(1, Dtype::F16), (4, Dtype::Bf16), (7, Dtype::F16)] {
                let shape = KernelShape::new(head_dim, gqa, dtype);
                let _ = decode_groups(&spec, &shape);
                let tune = TuneParams::default_for(&spec, &shape);
                let k = decode_kernels(&spec, &shape, &tune)
                    .unwrap_or_else(|e| panic!("{text} d{head_dim}: {e}"));
                assert!(k.source.contains(&format!("D = {head_dim};")), "{text}");
                // No shape falls off the tensor-core kernel that head_dim 128 takes.
                assert_eq!(
                    k.slow_path.is_none(),
                    fast_at_128,
                    "{text} d{head_dim}: {:?}",
                    k.slow_path
                );
                if k.slow_path.is_none() {
                    for side in ['K', 'V'] {
                        let (dv, slabs) = slabs_of(&k.source, side);
                        assert_eq!(slabs.iter().sum::<u32>(), dv, "{text} d{head_dim}");
                        // V slabs tile the row but for 1- and 2-bit codes in at most two slabs;
                        // K slabs reach past it by less than the coarsest code's least slab
                        // (1-bit keys on the integer path: 128).
                        if side == 'V' && !(low_bit_v && slabs.len() <= 2) {
                            assert_eq!(dv, head_dim, "{text} d{head_dim}: {slabs:?}");
                        }
                        assert!(
                            dv >= head_dim && dv - head_dim < 128,
                            "{text} d{head_dim}: {dv}"
                        );
                        // Powers of two, largest first, each starting at a multiple of its size.
                        let mut start = 0;
                        for (i, &s) in slabs.iter().enumerate() {
                            assert!(
                                s.is_power_of_two() && s >= 16,
                                "{text} d{head_dim}: {slabs:?}"
                            );
                            assert_eq!(start % s, 0, "{text} d{head_dim}: {slabs:?}");
                            if i > 0 {
                                assert!(s <= slabs[i - 1], "{slabs:?}");
                            }
                            start += s;
                        }
                        if head_dim.is_power_of_two() {
                            assert_eq!(slabs, [head_dim], "one slab at {head_dim}");
                        } else {
                            assert!(slabs.len() > 1 || dv > head_dim, "{slabs:?}");
                        }
                    }
                }
                rendered += 1;
            }
        }
    }
    assert!(rendered >= 3 * 13 * (SCHEMES.len() - 2), "{rendered}");
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
