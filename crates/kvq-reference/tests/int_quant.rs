//! Property tests of the scalar quantizers: the f16 parameters bracket every value, and every value
//! dequantizes within half a step.

use half::f16;
use kvq_reference::int::{f16_down, f16_up, Quantizer, F16_MAX};
use proptest::prelude::*;

/// Half a step, widened by the few f32 roundings between the value and its dequantization.
fn bound(scale: f16, x: f32, zero: f16) -> f32 {
    let s = scale.to_f32();
    s / 2.0 * (1.0 + 1e-5) + 4.0 * f32::EPSILON * (x.abs() + zero.to_f32().abs() + s)
}

fn group() -> impl Strategy<Value = Vec<f32>> {
    let value = prop_oneof![
        -8.0f32..8.0,
        -F16_MAX..F16_MAX,
        -1e-3f32..1e-3,
        Just(0.0f32),
        Just(1.0f32 / 3.0),
    ];
    (prop::collection::vec(value, 1..64), -100.0f32..100.0).prop_map(|(v, shift)| {
        v.into_iter()
            .map(|x| (x + shift).clamp(-F16_MAX, F16_MAX))
            .collect()
    })
}

proptest! {
    #[test]
    fn asymmetric_brackets_and_half_step(bits in prop::sample::select(vec![2u8, 3, 4, 8]), g in group()) {
        let q = Quantizer::new(bits, false).unwrap();
        let p = q.params(&g).unwrap();
        let mn = g.iter().copied().fold(f32::INFINITY, f32::min);
        let mx = g.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        prop_assert!(p.zero.to_f32() <= mn);
        prop_assert!(p.scale.to_f32().mul_add(q.levels() as f32, p.zero.to_f32()) >= mx);
        for &x in &g {
            let c = q.encode(x, p);
            prop_assert!(u32::from(c) <= q.levels());
            let err = (x - q.decode(c, p)).abs();
            prop_assert!(err <= bound(p.scale, x, p.zero), "x {} err {} scale {}", x, err, p.scale);
        }
    }

    #[test]
    fn one_bit_within_half_step_when_the_range_fits(g in group()) {
        let q = Quantizer::new(1, false).unwrap();
        let mn = g.iter().copied().fold(f32::INFINITY, f32::min);
        let mx = g.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        match q.params(&g) {
            Ok(p) => for &x in &g {
                let err = (x - q.decode(q.encode(x, p), p)).abs();
                prop_assert!(err <= bound(p.scale, x, p.zero));
            },
            // Only a range wider than the largest f16 scale may be refused.
            Err(_) => prop_assert!(mx - mn > F16_MAX / 2.0),
        }
    }

    #[test]
    fn symmetric_within_half_step(bits in prop::sample::select(vec![2u8, 3, 4, 8]), g in group()) {
        let q = Quantizer::new(bits, true).unwrap();
        let p = q.params(&g).unwrap();
        let amax = g.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        prop_assert!(p.scale.to_f32() * q.levels() as f32 >= amax);
        for &x in &g {
            let c = q.encode(x, p);
            prop_assert!(c >= 1 && u32::from(c) <= 2 * q.levels() + 1);
            let err = (x - q.decode(c, p)).abs();
            prop_assert!(err <= bound(p.scale, x, p.zero), "x {} err {} scale {}", x, err, p.scale);
        }
    }

    #[test]
    fn directed_rounding_is_tight(x in -F16_MAX..F16_MAX) {
        let (lo, hi) = (f16_down(x), f16_up(x));
        prop_assert!(lo.to_f32() <= x && x <= hi.to_f32());
        prop_assert!(hi.to_bits() == lo.to_bits() || hi.to_f32() > lo.to_f32());
        // No f16 strictly between them.
        let mid = f16::from_f32((lo.to_f32() + hi.to_f32()) / 2.0);
        prop_assert!(mid == lo || mid == hi);
    }
}

#[test]
fn int8_symmetric_matches_the_studys_definition() {
    // scale = max|x| / 127 (rounded up to f16), codes round to nearest and clamp to ±127.
    let q = Quantizer::new(8, true).unwrap();
    let g = [-1.27f32, 0.5, 1.0, 0.004];
    let p = q.params(&g).unwrap();
    assert_eq!(p.scale, f16_up(1.27 / 127.0));
    for &x in &g {
        let signed = i32::from(q.encode(x, p)) - 128;
        assert_eq!(signed, (x / p.scale.to_f32()).round_ties_even() as i32);
        assert!(signed.abs() <= 127);
    }
}
