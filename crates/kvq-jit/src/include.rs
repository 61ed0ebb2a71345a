//! Where the CUDA headers are, for sources that include them.
//!
//! kvq's generated kernels are meant to be header-free (DESIGN.md §3), so a machine with only
//! the driver and libnvrtc can compile them; then no include folder is needed and none is
//! required to exist. For sources that do include CUDA headers, the folders come from the first
//! of these that names an existing folder:
//!
//! 1. `KVQ_CUDA_INCLUDE`: one or more folders separated by `:` (CI points it at the pip package
//!    `nvidia-cuda-runtime`'s `include`);
//! 2. `$CUDA_HOME/include`;
//! 3. `/usr/local/cuda/include`.
//!
//! Each chosen folder's `cccl` subfolder is added too when it exists (CUDA 13 keeps `<nv/target>`
//! and the other CCCL headers there). Every candidate is recorded with what was found, so a
//! missing header can name them all ([`crate::MissingHeader`]).

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The environment variable holding extra include folders.
pub const KVQ_CUDA_INCLUDE: &str = "KVQ_CUDA_INCLUDE";
/// The toolkit root variable.
pub const CUDA_HOME: &str = "CUDA_HOME";
/// The conventional toolkit location.
pub const DEFAULT_CUDA_INCLUDE: &str = "/usr/local/cuda/include";

/// What was found at one candidate place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CandidateStatus {
    /// The variable naming it is not set.
    Unset,
    /// The folder does not exist.
    Missing,
    /// The folder exists and is used.
    Used,
    /// The folder exists but an earlier source was used instead.
    Skipped,
}

/// One place considered for CUDA headers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncludeCandidate {
    /// Where the candidate came from: `KVQ_CUDA_INCLUDE`, `$CUDA_HOME/include`, or the default.
    pub origin: String,
    /// The folder, if the variable was set.
    pub path: Option<PathBuf>,
    /// What was found there.
    pub status: CandidateStatus,
}

impl fmt::Display for IncludeCandidate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.path, self.status) {
            (None, _) | (_, CandidateStatus::Unset) => write!(f, "{}: not set", self.origin),
            (Some(p), CandidateStatus::Missing) => {
                write!(f, "{}: {} (does not exist)", self.origin, p.display())
            }
            (Some(p), CandidateStatus::Used) => {
                write!(f, "{}: {} (used)", self.origin, p.display())
            }
            (Some(p), CandidateStatus::Skipped) => write!(
                f,
                "{}: {} (exists, not used: an earlier source won)",
                self.origin,
                p.display()
            ),
        }
    }
}

/// The result of looking for CUDA include folders.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncludeSearch {
    /// Every candidate, in search order.
    pub candidates: Vec<IncludeCandidate>,
    /// The folders to pass to NVRTC (chosen folders and their `cccl` subfolders), in order.
    pub dirs: Vec<PathBuf>,
}

impl IncludeSearch {
    /// Searches using the process environment.
    pub fn from_env() -> IncludeSearch {
        let kvq = std::env::var(KVQ_CUDA_INCLUDE).ok();
        let home = std::env::var(CUDA_HOME).ok();
        IncludeSearch::from_vars(
            kvq.as_deref(),
            home.as_deref(),
            Path::new(DEFAULT_CUDA_INCLUDE),
        )
    }

    /// Searches with explicit values (`None` = unset) — the testable core of [`Self::from_env`].
    pub fn from_vars(
        kvq_cuda_include: Option<&str>,
        cuda_home: Option<&str>,
        default_dir: &Path,
    ) -> IncludeSearch {
        // Sources in order; each is a list of (origin, folder) candidates.
        let mut sources: Vec<Vec<(String, Option<PathBuf>)>> = Vec::new();
        match kvq_cuda_include.filter(|v| !v.trim().is_empty()) {
            Some(value) => sources.push(
                value
                    .split(':')
                    .filter(|p| !p.trim().is_empty())
                    .map(|p| (KVQ_CUDA_INCLUDE.to_string(), Some(PathBuf::from(p.trim()))))
                    .collect(),
            ),
            None => sources.push(vec![(KVQ_CUDA_INCLUDE.to_string(), None)]),
        }
        let home_include = cuda_home
            .filter(|v| !v.trim().is_empty())
            .map(|h| Path::new(h.trim()).join("include"));
        sources.push(vec![("$CUDA_HOME/include".to_string(), home_include)]);
        sources.push(vec![(
            "default location".to_string(),
            Some(default_dir.to_path_buf()),
        )]);

        let mut search = IncludeSearch::default();
        let mut chosen = false;
        for source in sources {
            let mut used_here = false;
            for (origin, path) in source {
                let status = match &path {
                    None => CandidateStatus::Unset,
                    Some(p) if !p.is_dir() => CandidateStatus::Missing,
                    Some(_) if chosen => CandidateStatus::Skipped,
                    Some(p) => {
                        used_here = true;
                        search.dirs.push(p.clone());
                        let cccl = p.join("cccl");
                        if cccl.is_dir() {
                            search.dirs.push(cccl);
                        }
                        CandidateStatus::Used
                    }
                };
                search.candidates.push(IncludeCandidate {
                    origin,
                    path,
                    status,
                });
            }
            chosen |= used_here;
        }
        search
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvq-include-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn nothing_set_nothing_found() {
        let s = IncludeSearch::from_vars(None, None, Path::new("/nonexistent/kvq/include"));
        assert!(s.dirs.is_empty());
        let statuses: Vec<_> = s.candidates.iter().map(|c| c.status).collect();
        assert_eq!(
            statuses,
            [
                CandidateStatus::Unset,
                CandidateStatus::Unset,
                CandidateStatus::Missing
            ]
        );
        assert_eq!(s.candidates[0].to_string(), "KVQ_CUDA_INCLUDE: not set");
    }

    #[test]
    fn kvq_cuda_include_wins_and_adds_cccl() {
        let a = temp_dir("a");
        let b = temp_dir("b");
        std::fs::create_dir_all(a.join("cccl")).unwrap();
        let home = temp_dir("home");
        std::fs::create_dir_all(home.join("include")).unwrap();
        let value = format!("{}:/nonexistent/x:{}", a.display(), b.display());
        let s = IncludeSearch::from_vars(
            Some(&value),
            Some(home.to_str().unwrap()),
            Path::new("/nonexistent"),
        );
        assert_eq!(s.dirs, vec![a.clone(), a.join("cccl"), b.clone()]);
        assert_eq!(s.candidates[1].status, CandidateStatus::Missing);
        assert_eq!(s.candidates[3].status, CandidateStatus::Skipped);
        for d in [a, b, home] {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    #[test]
    fn cuda_home_when_kvq_var_unset() {
        let home = temp_dir("home2");
        std::fs::create_dir_all(home.join("include")).unwrap();
        let s = IncludeSearch::from_vars(None, Some(home.to_str().unwrap()), Path::new("/nope"));
        assert_eq!(s.dirs, vec![home.join("include")]);
        let _ = std::fs::remove_dir_all(home);
    }
}
