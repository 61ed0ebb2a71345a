//! What a kernel is specialised for besides the scheme.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of queries and outputs. Cached FP16 regions are always IEEE half.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F16,
    Bf16,
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        })
    }
}

impl std::str::FromStr for Dtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f16" | "fp16" | "half" => Ok(Dtype::F16),
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            other => Err(format!("unknown dtype `{other}`: expected f16 or bf16")),
        }
    }
}

/// The problem shape a decode kernel is compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KernelShape {
    /// Channels per head (a multiple of 16).
    pub head_dim: u32,
    /// Query heads per KV head (GQA group size; 1 for MHA).
    pub gqa: u32,
    pub dtype: Dtype,
}

impl KernelShape {
    pub fn new(head_dim: u32, gqa: u32, dtype: Dtype) -> Self {
        Self {
            head_dim,
            gqa,
            dtype,
        }
    }
}
