//! Rotary position embedding (half-split convention: channel `i` pairs with `i + D/2`, as in
//! LLaMA's Hugging Face implementation).

/// RoPE parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    pub theta: f64,
}

impl Default for Rope {
    fn default() -> Self {
        Rope { theta: 500_000.0 }
    }
}

impl Rope {
    /// (cos, sin) of pair `i` of a `head_dim` vector at `position`.
    pub fn angle(&self, head_dim: usize, i: usize, position: usize) -> (f64, f64) {
        let freq = self.theta.powf(-2.0 * i as f64 / head_dim as f64);
        let a = position as f64 * freq;
        (a.cos(), a.sin())
    }

    /// Rotates `x` (one head's vector) in place to `position`.
    pub fn apply(&self, x: &mut [f32], position: usize) {
        let half = x.len() / 2;
        for i in 0..half {
            let (c, s) = self.angle(x.len(), i, position);
            let (a, b) = (x[i] as f64, x[i + half] as f64);
            x[i] = (a * c - b * s) as f32;
            x[i + half] = (a * s + b * c) as f32;
        }
    }

    /// The inverse rotation.
    pub fn unapply(&self, x: &mut [f32], position: usize) {
        let half = x.len() / 2;
        for i in 0..half {
            let (c, s) = self.angle(x.len(), i, position);
            let (a, b) = (x[i] as f64, x[i + half] as f64);
            x[i] = (a * c + b * s) as f32;
            x[i + half] = (-a * s + b * c) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_preserves_norm_and_inverts() {
        let rope = Rope::default();
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut y = x.clone();
        rope.apply(&mut y, 1234);
        let n = |v: &[f32]| v.iter().map(|a| (*a as f64).powi(2)).sum::<f64>();
        assert!((n(&x) - n(&y)).abs() < 1e-4);
        assert!(x.iter().zip(&y).any(|(a, b)| (a - b).abs() > 1e-3));
        rope.unapply(&mut y, 1234);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
