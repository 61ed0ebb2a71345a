//! The versions of the two CUDA libraries kvq loads: what the driver supports
//! ([`DriverVersion`]) and what NVRTC is ([`NvrtcVersion`]).
//!
//! Plain values with no dependency inside this crate, so that the error type can name them and
//! the modules that query them ([`crate::libs`], [`crate::device`], [`crate::nvrtc`]) can return
//! errors, without either importing the other.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The CUDA version the driver supports (`cuDriverGetVersion`: 13000 → 13.0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct DriverVersion {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
}

impl fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CUDA {}.{}", self.major, self.minor)
    }
}

/// The NVRTC library's version (`nvrtcVersion`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NvrtcVersion {
    /// Major version (13 for CUDA 13.x).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl fmt::Display for NvrtcVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}
