//! Exact storage of a CommVQ cache: per-sequence payload and metadata, and the per-layer codebooks
//! (shared by every sequence, so counted once and separately).

use super::cache::{Coding, CommVqCache, Stored};

/// Bits one tensor of one sequence occupies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TensorFootprint {
    /// Scalars held in quantized pages.
    pub quantized_elements: u64,
    /// Scalars held in FP16.
    pub fp16_elements: u64,
    /// Packed codes.
    pub code_bits: u64,
    /// Per-vector f16 scales/factors.
    pub scale_bits: u64,
    /// f16 codebook tensors of the layer (not per sequence).
    pub codebook_bits: u64,
}

impl TensorFootprint {
    /// Code bits per quantized scalar (the scheme's nominal rate).
    pub fn payload_bits_per_element(&self) -> f64 {
        self.code_bits as f64 / self.quantized_elements.max(1) as f64
    }

    /// Codes + scales + FP16 tokens per scalar of the sequence (codebooks excluded).
    pub fn bits_per_element(&self) -> f64 {
        (self.code_bits + self.scale_bits + 16 * self.fp16_elements) as f64
            / (self.quantized_elements + self.fp16_elements).max(1) as f64
    }
}

/// K and V of one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Footprint {
    pub k: TensorFootprint,
    pub v: TensorFootprint,
}

impl Footprint {
    /// Sequence bytes (codes, scales, FP16 tokens), codebooks excluded.
    pub fn sequence_bytes(&self) -> u64 {
        [self.k, self.v]
            .iter()
            .map(|t| t.code_bits + t.scale_bits + 16 * t.fp16_elements)
            .sum::<u64>()
            .div_ceil(8)
    }

    /// Codebook bytes of the layer.
    pub fn codebook_bytes(&self) -> u64 {
        (self.k.codebook_bits + self.v.codebook_bits).div_ceil(8)
    }

    /// Sequence bits per cached scalar of K and V together.
    pub fn bits_per_element(&self) -> f64 {
        let e = |t: &TensorFootprint| t.quantized_elements + t.fp16_elements;
        8.0 * self.sequence_bytes() as f64 / (e(&self.k) + e(&self.v)).max(1) as f64
    }
}

fn tensor(s: &Stored, kv_heads: usize, head_dim: usize) -> TensorFootprint {
    let per_token = (kv_heads * head_dim) as u64;
    let codebook_bits = match &s.coding {
        Coding::Fp16 => 0,
        Coding::Rope { codebook, .. } => 16 * codebook.entries.len() as u64,
        Coding::Additive(cb) => {
            16 * (cb.table.len() + cb.channel_scale.len() + cb.mean.len()) as u64
        }
    };
    TensorFootprint {
        quantized_elements: s.regions.quantized().len() as u64 * per_token,
        fp16_elements: s.fp16.len() as u64,
        code_bits: 32 * s.codes.len() as u64,
        scale_bits: 16 * s.scales.len() as u64,
        codebook_bits,
    }
}

impl CommVqCache {
    /// What this cache stores, bit for bit.
    pub fn footprint(&self) -> Footprint {
        Footprint {
            k: tensor(&self.k, self.kv_heads, self.head_dim),
            v: tensor(&self.v, self.kv_heads, self.head_dim),
        }
    }
}
