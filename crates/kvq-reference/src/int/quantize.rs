//! Scalar quantization of one group (`docs/LAYOUT.md` §3): f16 scale (and zero) chosen with directed
//! rounding so every value of the group stays representable, then round-to-nearest-even codes.
//!
//! Every step is a single IEEE-754 f32 operation (or an f32→f16 conversion with a named rounding
//! direction), so a GPU kernel using `__fsub_rn`, `__fdiv_rn`, `__fmaf_rn`, `__float2half_rd/ru` and
//! `rintf` reproduces the bytes exactly.

use crate::RefError;
use half::f16;

/// Largest finite f16: values beyond it cannot be cached.
pub const F16_MAX: f32 = 65504.0;

/// The next f16 towards +∞ (from ±0: the smallest positive subnormal).
pub fn f16_next_up(h: f16) -> f16 {
    let b = h.to_bits();
    let r = if b & 0x7fff == 0 {
        0x0001
    } else if b & 0x8000 == 0 {
        b + 1
    } else {
        b - 1
    };
    f16::from_bits(r)
}

/// The next f16 towards −∞.
pub fn f16_next_down(h: f16) -> f16 {
    -f16_next_up(-h)
}

/// The largest f16 ≤ `x` (CUDA `__float2half_rd`).
pub fn f16_down(x: f32) -> f16 {
    let h = f16::from_f32(x);
    if h.to_f32() > x {
        f16_next_down(h)
    } else {
        h
    }
}

/// The smallest f16 ≥ `x` (CUDA `__float2half_ru`); +∞ above [`F16_MAX`].
pub fn f16_up(x: f32) -> f16 {
    let h = f16::from_f32(x);
    if h.to_f32() < x {
        f16_next_up(h)
    } else {
        h
    }
}

/// The stored parameters of one group. `zero` is 0 for symmetric quantizers (not stored).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupParams {
    pub scale: f16,
    pub zero: f16,
}

/// A `bits`-bit quantizer, asymmetric (scale + zero, codes `0..=2^b−1`) or symmetric (scale only,
/// codes `−(2^(b−1)−1)..=2^(b−1)−1` stored offset-binary as `code + 2^(b−1)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantizer {
    pub bits: u8,
    pub symmetric: bool,
}

/// Directed rounding leaves the scale at most a few f16 ulps short; more is a logic error.
const MAX_SCALE_BUMPS: usize = 8;

impl Quantizer {
    pub fn new(bits: u8, symmetric: bool) -> Result<Self, RefError> {
        if !(1..=8).contains(&bits) || (symmetric && bits < 2) {
            return Err(RefError::Mismatch(format!(
                "no {} {bits}-bit quantizer",
                if symmetric { "symmetric" } else { "asymmetric" }
            )));
        }
        Ok(Self { bits, symmetric })
    }

    /// The largest code magnitude: `2^b − 1` (asymmetric) or `2^(b−1) − 1` (symmetric).
    pub fn levels(&self) -> u32 {
        if self.symmetric {
            (1 << (self.bits - 1)) - 1
        } else {
            (1 << self.bits) - 1
        }
    }

    /// What is added to a signed code before packing: `2^(b−1)` (symmetric) or 0.
    pub fn offset(&self) -> u32 {
        if self.symmetric {
            1 << (self.bits - 1)
        } else {
            0
        }
    }

    /// Scale (and zero) of a group of finite values within ±[`F16_MAX`].
    pub fn params(&self, group: &[f32]) -> Result<GroupParams, RefError> {
        let l = self.levels() as f32;
        let zero_params = GroupParams {
            scale: f16::ZERO,
            zero: f16::ZERO,
        };
        if group.is_empty() {
            return Ok(zero_params);
        }
        let (zero, top) = if self.symmetric {
            let amax = group.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            (f16::ZERO, amax)
        } else {
            let mn = group.iter().copied().fold(f32::INFINITY, f32::min);
            let mx = group.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            (f16_down(mn), mx)
        };
        let zf = zero.to_f32();
        if !zf.is_finite() {
            return Err(RefError::Mismatch(format!(
                "group minimum {} is outside the f16 range",
                group.iter().copied().fold(f32::INFINITY, f32::min)
            )));
        }
        if top == zf {
            return Ok(GroupParams {
                scale: f16::ZERO,
                zero,
            });
        }
        // Scale rounded up, then widened until the top level reaches the group's maximum.
        let mut scale = f16_up((top - zf) / l);
        for _ in 0..MAX_SCALE_BUMPS {
            if !scale.is_finite() {
                break;
            }
            if scale.to_f32().mul_add(l, zf) >= top {
                return Ok(GroupParams { scale, zero });
            }
            scale = f16_next_up(scale);
        }
        Err(RefError::Mismatch(format!(
            "a {}-bit group spanning [{zf}, {top}] needs a scale beyond the f16 range",
            self.bits
        )))
    }

    /// The code of `x` (a member of the group `p` was computed from).
    pub fn encode(&self, x: f32, p: GroupParams) -> u8 {
        let l = self.levels() as f32;
        let s = p.scale.to_f32();
        if s == 0.0 {
            return self.offset() as u8;
        }
        if self.symmetric {
            let q = (x / s).round_ties_even().clamp(-l, l);
            (q as i32 + self.offset() as i32) as u8
        } else {
            let q = ((x - p.zero.to_f32()) / s).round_ties_even().clamp(0.0, l);
            q as u8
        }
    }

    /// [`Quantizer::encode`] computed as the GPU page quantizers do, without a division per value:
    /// with `inv = 1/scale` correctly rounded (0 for a zero scale), `q0 = d·inv`, the exact residual
    /// `r = fma(−q0, scale, d)` and `q = fma(r, inv, q0)` is the correctly rounded `d / scale`
    /// (Markstein's theorem), so its round-half-even is the reference's code. Clamping before the
    /// rounding equals clamping after (the bounds are integers). Kept here so the identity is
    /// tested on every f16 scale (see the tests), not only where a GPU is.
    pub fn encode_by_reciprocal(&self, x: f32, p: GroupParams) -> u8 {
        let l = self.levels() as f32;
        let s = p.scale.to_f32();
        let inv = if s == 0.0 { 0.0 } else { 1.0 / s };
        let d = if self.symmetric {
            x
        } else {
            x - p.zero.to_f32()
        };
        let q0 = d * inv;
        let r = (-q0).mul_add(s, d);
        let q = r.mul_add(inv, q0);
        let lo = if self.symmetric { -l } else { 0.0 };
        // Adding 1.5·2^23 rounds to an integer, half to even, like `rintf`.
        const ROUND: f32 = 12_582_912.0;
        let rounded = (q.clamp(lo, l) + ROUND) - ROUND;
        (rounded as i32 + self.offset() as i32) as u8
    }

    /// The value a code stands for: `fma(scale, code, zero)` or `scale · (code − 2^(b−1))` in f32.
    pub fn decode(&self, code: u8, p: GroupParams) -> f32 {
        let s = p.scale.to_f32();
        if self.symmetric {
            s * (i32::from(code) - self.offset() as i32) as f32
        } else {
            s.mul_add(f32::from(code), p.zero.to_f32())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directed_rounding_brackets_the_value() {
        for x in [0.1f32, -0.1, 1.0 / 3.0, 65503.9, -65503.9, 1e-9, -1e-9, 0.0] {
            assert!(f16_down(x).to_f32() <= x && f16_up(x).to_f32() >= x, "{x}");
            assert!(
                f16_up(x).to_f32() - f16_down(x).to_f32()
                    <= f16_next_up(f16_down(x)).to_f32() - f16_down(x).to_f32()
            );
        }
        assert_eq!(f16_up(1.0), f16::ONE);
        assert_eq!(f16_down(1.0), f16::ONE);
        assert!(f16_up(70000.0).is_infinite());
        assert_eq!(f16_up(1e-12).to_bits(), 1);
    }

    #[test]
    fn reciprocal_encoding_equals_division_on_every_f16_scale() {
        // Every positive finite f16 scale; values on and next to every half-way point of every
        // level (where a plain `d · (1/s)` would round the wrong way), asymmetric and symmetric.
        let mut checked = 0u64;
        for bits in 1u16..0x7c00 {
            let scale = f16::from_bits(bits);
            let s = scale.to_f32();
            for (q, zero) in [
                (Quantizer::new(2, false).unwrap(), f16::from_f32(-1.5)),
                (Quantizer::new(8, false).unwrap(), f16::from_f32(0.25)),
                (Quantizer::new(8, true).unwrap(), f16::ZERO),
            ] {
                let p = GroupParams { scale, zero };
                let z = zero.to_f32();
                for k in (-(q.levels() as i32) - 1..=q.levels() as i32 + 1).step_by(7) {
                    let mid = z + (k as f32 + 0.5) * s;
                    for x in [mid, mid.next_up(), mid.next_down(), z + k as f32 * s] {
                        if x.is_finite() && (x - z).abs() / s < 1e6 {
                            assert_eq!(
                                q.encode_by_reciprocal(x, p),
                                q.encode(x, p),
                                "{q:?} s={s:e} x={x:e}"
                            );
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert!(checked > 1_000_000, "{checked}");
        // The group parameters divide a span by the level count the same way on the GPU.
        let mut x = 1.0e-20f32;
        while x < 1.0e20 {
            for levels in [1.0f32, 3.0, 7.0, 15.0, 127.0, 255.0] {
                for span in [x, x.next_up(), x.next_down(), x * 1.5, x * levels] {
                    let inv = 1.0 / levels;
                    let q0 = span * inv;
                    let q = (-q0).mul_add(levels, span).mul_add(inv, q0);
                    assert_eq!(q, span / levels, "{span:e} / {levels}");
                }
            }
            x *= 1.000_37;
        }
    }

    #[test]
    fn constant_groups_are_exact_with_zero_scale() {
        for bits in [1, 2, 3, 4, 8] {
            let q = Quantizer::new(bits, false).unwrap();
            let p = q.params(&[0.75; 5]).unwrap();
            assert_eq!(p.scale, f16::ZERO);
            assert_eq!(q.decode(q.encode(0.75, p), p), 0.75);
        }
        let q = Quantizer::new(8, true).unwrap();
        let p = q.params(&[0.0; 3]).unwrap();
        assert_eq!(q.decode(q.encode(0.0, p), p), 0.0);
    }

    #[test]
    fn symmetric_codes_are_offset_binary() {
        let q = Quantizer::new(8, true).unwrap();
        let p = q.params(&[-2.0, 1.0, 2.0]).unwrap();
        assert_eq!(q.encode(2.0, p), 128 + 127);
        assert_eq!(q.encode(-2.0, p), 128 - 127);
        assert_eq!(q.encode(0.0, p), 128);
    }

    #[test]
    fn one_bit_range_beyond_f16_is_an_error() {
        let q = Quantizer::new(1, false).unwrap();
        assert!(q.params(&[-60000.0, 60000.0]).is_err());
        assert!(Quantizer::new(1, true).is_err());
    }
}
