//! GPU architectures as NVRTC names them: `sm_80`, `sm_90a`, `sm_100f`, ….
//!
//! An [`Arch`] is a compute capability plus a variant suffix. The JIT compiles for the exact
//! architecture of the device at hand ([`Arch::for_compute_capability`]), which picks the
//! architecture-specific `a` variant from compute capability 9.0 on (`sm_90a` on Hopper), so
//! generated kernels may use `wgmma`, TMA and the other features that only exist there.
//! Compiling needs no GPU: CI passes an explicit `Arch`, e.g. `"sm_80".parse()`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// An architecture name that does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid GPU architecture `{text}`: {reason} (expected a name like sm_80 or sm_90a)")]
pub struct InvalidArch {
    /// The text given.
    pub text: String,
    /// Why it was rejected.
    pub reason: String,
}

/// The suffix of an architecture name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ArchVariant {
    /// `sm_80`: runs on this compute capability and (as PTX) later ones.
    Generic,
    /// `sm_90a`: architecture-specific features; the binary runs on exactly this capability.
    Specific,
    /// `sm_100f`: family-specific features (CUDA 12.9+), runs on the same family.
    Family,
}

impl ArchVariant {
    fn suffix(self) -> &'static str {
        match self {
            ArchVariant::Generic => "",
            ArchVariant::Specific => "a",
            ArchVariant::Family => "f",
        }
    }
}

/// A real GPU architecture (`sm_XY[a|f]`), usable for both PTX and CUBIN output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arch {
    major: u32,
    minor: u32,
    variant: ArchVariant,
}

impl Arch {
    /// Ampere A100 (`sm_80`).
    pub const SM_80: Arch = Arch::new(8, 0);
    /// Ampere consumer (`sm_86`).
    pub const SM_86: Arch = Arch::new(8, 6);
    /// Ada (`sm_89`).
    pub const SM_89: Arch = Arch::new(8, 9);
    /// Hopper, portable subset (`sm_90`).
    pub const SM_90: Arch = Arch::new(9, 0);
    /// Hopper with its architecture-specific features (`sm_90a`): what the JIT uses on H100/H200.
    pub const SM_90A: Arch = Arch::new(9, 0).with_variant(ArchVariant::Specific);

    /// The generic architecture of compute capability `major.minor`.
    pub const fn new(major: u32, minor: u32) -> Arch {
        Arch {
            major,
            minor,
            variant: ArchVariant::Generic,
        }
    }

    /// The same compute capability with another suffix.
    pub const fn with_variant(self, variant: ArchVariant) -> Arch {
        Arch { variant, ..self }
    }

    /// The architecture the JIT compiles for on a device of compute capability `major.minor`:
    /// the `a` variant from 9.0 on (`sm_90a`, `sm_100a`, `sm_120a`), the generic one before.
    pub const fn for_compute_capability(major: u32, minor: u32) -> Arch {
        let arch = Arch::new(major, minor);
        if major >= 9 {
            arch.with_variant(ArchVariant::Specific)
        } else {
            arch
        }
    }

    /// `(major, minor)`.
    pub const fn compute_capability(self) -> (u32, u32) {
        (self.major, self.minor)
    }

    /// The number in the name: 80 for `sm_80`, 90 for `sm_90a`, 120 for `sm_120`.
    pub const fn sm(self) -> u32 {
        self.major * 10 + self.minor
    }

    /// The suffix.
    pub const fn variant(self) -> ArchVariant {
        self.variant
    }

    /// The NVRTC option selecting this architecture: `--gpu-architecture=sm_90a`.
    pub fn nvrtc_option(self) -> String {
        format!("--gpu-architecture={self}")
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}{}", self.sm(), self.variant.suffix())
    }
}

impl FromStr for Arch {
    type Err = InvalidArch;

    /// Parses `sm_80`, `sm_90a`, `sm_100f`; also `compute_90a` and bare `90a`.
    fn from_str(text: &str) -> Result<Arch, InvalidArch> {
        let invalid = |reason: &str| InvalidArch {
            text: text.to_string(),
            reason: reason.to_string(),
        };
        let t = text.trim();
        let rest = t
            .strip_prefix("sm_")
            .or_else(|| t.strip_prefix("compute_"))
            .unwrap_or(t);
        let (digits, variant) = match rest.strip_suffix('a') {
            Some(d) => (d, ArchVariant::Specific),
            None => match rest.strip_suffix('f') {
                Some(d) => (d, ArchVariant::Family),
                None => (rest, ArchVariant::Generic),
            },
        };
        if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(invalid(
                "expected sm_<major><minor> with an optional a/f suffix, e.g. sm_80, sm_90a",
            ));
        }
        let n: u32 = digits
            .parse()
            .map_err(|_| invalid("architecture number out of range"))?;
        let (major, minor) = (n / 10, n % 10);
        if major < 3 {
            return Err(invalid("compute capability below 3.0 is not a CUDA target"));
        }
        Ok(Arch::new(major, minor).with_variant(variant))
    }
}

impl Serialize for Arch {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Arch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Arch, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::JitError;

    #[test]
    fn parse_and_display_round_trip() {
        for name in [
            "sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100a", "sm_120f",
        ] {
            let arch: Arch = name.parse().unwrap();
            assert_eq!(arch.to_string(), name);
        }
        assert_eq!("compute_90a".parse::<Arch>().unwrap(), Arch::SM_90A);
        assert_eq!("80".parse::<Arch>().unwrap(), Arch::SM_80);
        assert_eq!(Arch::SM_90A.nvrtc_option(), "--gpu-architecture=sm_90a");
        assert_eq!(
            "sm_100a".parse::<Arch>().unwrap().compute_capability(),
            (10, 0)
        );
    }

    #[test]
    fn bad_names_are_typed_errors() {
        for bad in ["", "sm_", "sm_9x", "sm_8", "gfx90a", "sm_20", "sm_90b"] {
            let err = bad.parse::<Arch>().unwrap_err();
            assert_eq!(err.text, bad);
            assert!(err.to_string().contains("sm_90a"), "{err}");
            // Wrapped in the crate's error, the message is unchanged.
            assert_eq!(JitError::from(err.clone()).to_string(), err.to_string());
        }
    }

    #[test]
    fn device_arch_uses_the_specific_variant_from_hopper_on() {
        assert_eq!(Arch::for_compute_capability(8, 0), Arch::SM_80);
        assert_eq!(Arch::for_compute_capability(9, 0), Arch::SM_90A);
        assert_eq!(Arch::for_compute_capability(10, 0).to_string(), "sm_100a");
    }

    #[test]
    fn serde_as_string() {
        let json = serde_json::to_string(&Arch::SM_90A).unwrap();
        assert_eq!(json, "\"sm_90a\"");
        assert_eq!(serde_json::from_str::<Arch>(&json).unwrap(), Arch::SM_90A);
    }
}
