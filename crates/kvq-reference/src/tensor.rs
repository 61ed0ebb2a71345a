//! Plain head-major tensors, the currency of the reference.

use crate::RefError;

/// `[kv_heads][tokens][head_dim]` values of one sequence's K or V.
#[derive(Debug, Clone, PartialEq)]
pub struct KvTensor {
    pub data: Vec<f32>,
    pub kv_heads: usize,
    pub tokens: usize,
    pub head_dim: usize,
}

impl KvTensor {
    /// Wraps `data`, checking its length against the shape.
    pub fn new(
        data: Vec<f32>,
        kv_heads: usize,
        tokens: usize,
        head_dim: usize,
    ) -> Result<Self, RefError> {
        let expected = crate::resources::product(&[kv_heads, tokens, head_dim]);
        if expected != Some(data.len()) {
            return Err(RefError::Mismatch(format!(
                "{} values for [kv_heads {kv_heads}][tokens {tokens}][head_dim {head_dim}] = {}",
                data.len(),
                expected.map_or("more than 2^64".to_string(), |n| n.to_string())
            )));
        }
        Ok(Self {
            data,
            kv_heads,
            tokens,
            head_dim,
        })
    }

    /// All zeros of the given shape.
    pub fn zeros(kv_heads: usize, tokens: usize, head_dim: usize) -> Self {
        Self {
            data: vec![0.0; kv_heads * tokens * head_dim],
            kv_heads,
            tokens,
            head_dim,
        }
    }

    /// All zeros of the given shape, or an error when the shape is larger than the memory
    /// available ([`crate::resources`]); `what` names the tensor in that error.
    pub fn try_zeros(
        kv_heads: usize,
        tokens: usize,
        head_dim: usize,
        what: &str,
    ) -> Result<Self, RefError> {
        let what = format!("{what} ([kv_heads {kv_heads}][tokens {tokens}][head_dim {head_dim}])");
        Ok(Self {
            data: crate::resources::try_vec_of(&[kv_heads, tokens, head_dim], 0.0, &what)?,
            kv_heads,
            tokens,
            head_dim,
        })
    }

    /// One head's `[tokens][head_dim]` block.
    pub fn head(&self, h: usize) -> &[f32] {
        let n = self.tokens * self.head_dim;
        &self.data[h * n..(h + 1) * n]
    }

    pub fn head_mut(&mut self, h: usize) -> &mut [f32] {
        let n = self.tokens * self.head_dim;
        &mut self.data[h * n..(h + 1) * n]
    }

    /// One token's vector in one head.
    pub fn row(&self, h: usize, t: usize) -> &[f32] {
        let start = (h * self.tokens + t) * self.head_dim;
        &self.data[start..start + self.head_dim]
    }

    pub fn row_mut(&mut self, h: usize, t: usize) -> &mut [f32] {
        let start = (h * self.tokens + t) * self.head_dim;
        &mut self.data[start..start + self.head_dim]
    }

    /// The first `tokens` tokens of every head (a prefix of the sequence).
    pub fn prefix(&self, tokens: usize) -> KvTensor {
        let tokens = tokens.min(self.tokens);
        let mut out = KvTensor::zeros(self.kv_heads, tokens, self.head_dim);
        for h in 0..self.kv_heads {
            out.head_mut(h)
                .copy_from_slice(&self.head(h)[..tokens * self.head_dim]);
        }
        out
    }

    /// Rejects NaN/Inf with the position of the first one.
    pub fn check_finite(&self, tensor: &'static str) -> Result<(), RefError> {
        match self.data.iter().position(|x| !x.is_finite()) {
            None => Ok(()),
            Some(i) => {
                let channel = i % self.head_dim;
                let token = (i / self.head_dim) % self.tokens.max(1);
                let head = i / (self.head_dim * self.tokens.max(1));
                Err(RefError::NonFinite {
                    tensor,
                    head,
                    token,
                    channel,
                    value: self.data[i],
                })
            }
        }
    }
}

/// What every scheme's cache dequantizes to: K̂ and V̂ as the kernels see them, and which tokens'
/// keys came from quantized pages (CalibQuant calibrates exactly those scores).
#[derive(Debug, Clone, PartialEq)]
pub struct Dequantized {
    pub k: KvTensor,
    pub v: KvTensor,
    pub k_quantized: Vec<bool>,
}
