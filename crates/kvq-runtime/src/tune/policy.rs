//! When the tuner may spend GPU time: never, only by reading stored results, or tuning misses.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Result, RuntimeError};

/// The environment variable that sets the policy of [`Tuner::new`](super::Tuner::new).
pub const KVQ_TUNE: &str = "KVQ_TUNE";

/// How [`Tuner::choose`](super::Tuner::choose) finds a configuration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TunePolicy {
    /// Always the heuristic default; the store is not read (reproducible launches).
    Off,
    /// A stored result when there is one, else the heuristic default; never times anything, so
    /// start-up cost stays predictable. The default.
    #[default]
    Cached,
    /// A stored result when there is one; otherwise tune now (seconds) and store the result.
    Full,
}

impl TunePolicy {
    /// The policy in `KVQ_TUNE`; [`TunePolicy::Cached`] when unset or empty.
    pub fn from_env() -> Result<TunePolicy> {
        Self::from_env_value(std::env::var(KVQ_TUNE).ok().as_deref())
    }

    /// The policy for a value of `KVQ_TUNE` (`None` when unset), for callers that read the
    /// environment themselves.
    pub fn from_env_value(value: Option<&str>) -> Result<TunePolicy> {
        match value.map(str::trim) {
            None | Some("") => Ok(TunePolicy::default()),
            Some(text) => parse(text).ok_or_else(|| {
                RuntimeError::InvalidInput(format!(
                    "{KVQ_TUNE}=`{text}` is not a tuning policy: expected {ACCEPTED} (unset \
                     means cached)"
                ))
            }),
        }
    }

    /// The name `KVQ_TUNE` accepts.
    pub fn as_str(self) -> &'static str {
        match self {
            TunePolicy::Off => "off",
            TunePolicy::Cached => "cached",
            TunePolicy::Full => "full",
        }
    }
}

impl fmt::Display for TunePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TunePolicy {
    type Err = RuntimeError;

    fn from_str(s: &str) -> Result<TunePolicy> {
        parse(s).ok_or_else(|| {
            RuntimeError::InvalidInput(format!(
                "unknown tuning policy `{}`: expected {ACCEPTED}",
                s.trim()
            ))
        })
    }
}

/// The accepted names, as messages list them.
const ACCEPTED: &str = "off, cached or full";

/// The one parser of policy names (case and surrounding spaces ignored).
fn parse(text: &str) -> Option<TunePolicy> {
    match text.trim().to_ascii_lowercase().as_str() {
        "off" => Some(TunePolicy::Off),
        "cached" => Some(TunePolicy::Cached),
        "full" => Some(TunePolicy::Full),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_policy_case_insensitively() {
        assert_eq!("off".parse::<TunePolicy>().unwrap(), TunePolicy::Off);
        assert_eq!(
            " Cached ".parse::<TunePolicy>().unwrap(),
            TunePolicy::Cached
        );
        assert_eq!("FULL".parse::<TunePolicy>().unwrap(), TunePolicy::Full);
        for p in [TunePolicy::Off, TunePolicy::Cached, TunePolicy::Full] {
            assert_eq!(p.to_string().parse::<TunePolicy>().unwrap(), p);
        }
    }

    #[test]
    fn unset_or_empty_means_cached_and_junk_is_an_error() {
        assert_eq!(
            TunePolicy::from_env_value(None).unwrap(),
            TunePolicy::Cached
        );
        assert_eq!(
            TunePolicy::from_env_value(Some("  ")).unwrap(),
            TunePolicy::Cached
        );
        let err = TunePolicy::from_env_value(Some("fast")).unwrap_err();
        let msg = err.to_string();
        assert_eq!(
            msg,
            "invalid input: KVQ_TUNE=`fast` is not a tuning policy: expected off, cached or full \
             (unset means cached)"
        );
        assert!(matches!(err, RuntimeError::InvalidInput(_)));
    }
}
