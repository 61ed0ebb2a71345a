//! The canonical text of a scheme: keyword arguments, defaults left out, so that
//! `SchemeSpec::parse(&spec.to_string()) == Ok(spec)`.

use crate::types::*;
use std::fmt::{self, Display, Formatter};

impl Display for TensorQuant {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match self {
            TensorQuant::Fp16 => f.write_str("fp16"),
            TensorQuant::Int(q) => {
                let axis = match q.axis {
                    Axis::Channel => "channel",
                    Axis::Token => "token",
                };
                write!(f, "int(bits = {}, axis = {axis}", q.bits)?;
                if let Some(g) = q.group {
                    write!(f, ", group = {g}")?;
                }
                if q.symmetric {
                    f.write_str(", symmetric")?;
                }
                if let Some(b) = q.boost {
                    let by = match b.by {
                        BoostCriterion::Magnitude => "magnitude",
                        BoostCriterion::Variance => "variance",
                    };
                    write!(
                        f,
                        ", boost = boost(bits = {}, ratio = {}, by = {by})",
                        b.bits, b.ratio
                    )?;
                }
                if let Some(l) = q.local {
                    write!(f, ", local = {l}")?;
                }
                f.write_str(")")
            }
            TensorQuant::Codebook(c) => {
                match c.codebook {
                    Codebook::RopeCommutative {
                        levels,
                        residuals,
                        pairs_per_code,
                    } => write!(
                        f,
                        "codebook(rope_commutative, levels = {levels}, residuals = {residuals}, pairs_per_code = {pairs_per_code}"
                    )?,
                    Codebook::Additive { rows } => write!(f, "codebook(additive, rows = {rows}")?,
                }
                if c.span == CodebookSpan::Token {
                    f.write_str(", span = token")?;
                }
                f.write_str(")")
            }
        }
    }
}

impl Display for SchemeSpec {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "k = {}, v = {}, page = {}", self.k, self.v, self.page)?;
        if self.sink > 0 {
            write!(f, ", sink = {}", self.sink)?;
        }
        if self.local > 0 {
            write!(f, ", local = {}", self.local)?;
        }
        if let Some(c) = self.calibrate {
            write!(
                f,
                ", calibrate = calibrate(tau1 = {}, tau2 = {})",
                c.tau1, c.tau2
            )?;
        }
        match self.source {
            CacheSource::Kv => {}
            CacheSource::X(XSource::Latent) => f.write_str(", source = x(latent)")?,
            CacheSource::X(XSource::CrossLayer) => f.write_str(", source = x(cross_layer)")?,
        }
        Ok(())
    }
}
