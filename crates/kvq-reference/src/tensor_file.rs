//! What kvq's safetensors files share (codebooks, `commvq::file`; XQuant projections,
//! `xquant::file`): the expected tensors checked by name, dtype and shape with no others allowed,
//! safetensors' errors as sentences, and saving through a temporary file renamed into place.

use crate::resources;
use safetensors::tensor::Metadata;
use safetensors::Dtype;
use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};

/// One tensor a file must hold: its name, shape and dtype.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Expected {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: Dtype,
}

/// Why a file's tensors are not the expected ones.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum TensorProblem {
    Missing {
        tensor: String,
        expected: Vec<usize>,
    },
    WrongDtype {
        tensor: String,
        expected: &'static str,
        found: String,
    },
    Shape {
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    /// A tensor the format has no use for (the sorted first one), with the expected list.
    Unexpected { tensor: String, expected: String },
    /// Offsets outside the data (the safetensors parser checks them first; kept total anyway).
    OutOfFile { tensor: String },
}

impl std::fmt::Display for TensorProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorProblem::Missing { tensor, expected } => {
                write!(
                    f,
                    "tensor `{tensor}` is missing (shape {expected:?} expected)"
                )
            }
            TensorProblem::WrongDtype {
                tensor,
                expected,
                found,
            } => write!(f, "tensor `{tensor}` is {found}, expected {expected}"),
            TensorProblem::Shape {
                tensor,
                expected,
                found,
            } => write!(
                f,
                "tensor `{tensor}` has shape {found:?}, expected {expected:?}"
            ),
            TensorProblem::Unexpected { tensor, expected } => write!(
                f,
                "unexpected tensor `{tensor}`: the file holds only {expected}"
            ),
            TensorProblem::OutOfFile { tensor } => {
                write!(f, "tensor `{tensor}`'s data offsets lie outside the file")
            }
        }
    }
}

/// The bytes of each of `expected` in a parsed header and the data after it, checked for presence,
/// dtype and shape, in `expected`'s order; then that the file holds no other tensor.
pub(crate) fn tensor_bytes<'a>(
    meta: &Metadata,
    data: &'a [u8],
    expected: &[Expected],
) -> Result<Vec<&'a [u8]>, TensorProblem> {
    let mut out = Vec::with_capacity(expected.len());
    for e in expected {
        let info = meta.info(&e.name).ok_or_else(|| TensorProblem::Missing {
            tensor: e.name.clone(),
            expected: e.shape.clone(),
        })?;
        if info.dtype != e.dtype {
            return Err(TensorProblem::WrongDtype {
                tensor: e.name.clone(),
                expected: dtype_name(e.dtype),
                found: format!("{:?}", info.dtype),
            });
        }
        if info.shape != e.shape {
            return Err(TensorProblem::Shape {
                tensor: e.name.clone(),
                expected: e.shape.clone(),
                found: info.shape.clone(),
            });
        }
        let (start, end) = info.data_offsets;
        out.push(
            data.get(start..end)
                .ok_or_else(|| TensorProblem::OutOfFile {
                    tensor: e.name.clone(),
                })?,
        );
    }
    let known: BTreeSet<&str> = expected.iter().map(|e| e.name.as_str()).collect();
    // Sorted, so that the same file always names the same tensor.
    let extra: BTreeSet<String> = meta
        .tensors()
        .into_keys()
        .filter(|n| !known.contains(n.as_str()))
        .collect();
    if let Some(name) = extra.into_iter().next() {
        return Err(TensorProblem::Unexpected {
            tensor: name,
            expected: describe(expected),
        });
    }
    Ok(out)
}

fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F16 => "F16",
        Dtype::F32 => "F32",
        Dtype::F64 => "F64",
        _ => "another dtype",
    }
}

/// "`k.entries`, `v.table`, …", or "no tensors".
fn describe(expected: &[Expected]) -> String {
    if expected.is_empty() {
        return "no tensors".into();
    }
    expected
        .iter()
        .map(|e| format!("`{}`", e.name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A safetensors error as a sentence (the crate's own are bare variant names).
pub(crate) fn safetensors_problem(e: &safetensors::SafeTensorError, len: usize) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::HeaderTooSmall => format!(
            "{len} bytes, fewer than the 8-byte header length a safetensors file starts with"
        ),
        E::HeaderTooLarge | E::InvalidHeaderLength => {
            "its first 8 bytes give a header length the file does not hold".into()
        }
        E::InvalidHeader | E::InvalidHeaderStart | E::InvalidHeaderDeserialization => {
            "the header is not the JSON of a safetensors file".into()
        }
        E::TensorInvalidInfo => "a tensor's shape and dtype disagree with its data offsets".into(),
        E::InvalidOffset(name) => format!("tensor `{name}`'s data offsets do not follow on"),
        E::MetadataIncompleteBuffer => {
            "the tensors' data does not cover the bytes after the header exactly".into()
        }
        E::ValidationOverflow => "a tensor's size in bytes overflows".into(),
        other => format!("{other}"),
    }
}

/// Little-endian f32 values of an F32 tensor's bytes.
pub(crate) fn f32_values(name: &str, data: &[u8]) -> Result<Vec<f32>, resources::AllocError> {
    let mut out = resources::try_with_capacity(data.len() / 4, &format!("tensor `{name}`"))?;
    out.extend(
        data.chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
    );
    Ok(out)
}

/// Little-endian f64 values of an F64 tensor's bytes.
pub(crate) fn f64_values(name: &str, data: &[u8]) -> Result<Vec<f64>, resources::AllocError> {
    let mut out = resources::try_with_capacity(data.len() / 8, &format!("tensor `{name}`"))?;
    out.extend(data.chunks_exact(8).map(|b| {
        let mut w = [0u8; 8];
        w.copy_from_slice(b);
        f64::from_le_bytes(w)
    }));
    Ok(out)
}

/// A temporary name next to `path`, unique to this process and call, so concurrent saves of one
/// file do not write into each other's temporary; the error says the path names no file.
fn temporary_path(path: &Path) -> Result<PathBuf, String> {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let name = path
        .file_name()
        .ok_or_else(|| "the path names no file".to_string())?;
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut tmp = std::ffi::OsString::from(".");
    tmp.push(name);
    tmp.push(format!(".tmp-{}-{n}", std::process::id()));
    Ok(path.with_file_name(tmp))
}

/// Writes and syncs a temporary file, then renames it to `path`; the temporary is removed on
/// failure. The error says which step failed (the caller names `path`).
pub(crate) fn write_atomically(path: &Path, bytes: &[u8], what: &str) -> Result<(), String> {
    let tmp = temporary_path(path).map_err(|why| format!("cannot write {what}: {why}"))?;
    let io = |step: &str, e: std::io::Error| format!("cannot {step} `{}`: {e}", tmp.display());
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| io("create the temporary file", e))
        .and_then(|mut f| {
            f.write_all(bytes)
                .map_err(|e| io("write the temporary file", e))?;
            // On disk before the rename, so a crash leaves the old file or the new one.
            f.sync_all().map_err(|e| io("flush the temporary file", e))
        })
        .and_then(|()| {
            std::fs::rename(&tmp, path).map_err(|e| io("rename into place the temporary file", e))
        });
    if written.is_err() {
        // Best effort: the temporary may not exist (creation failed), and the first error matters.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Why a file's metadata is not what its format writes (each format maps it to its own error).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum MetaProblem {
    Missing {
        key: &'static str,
    },
    UnknownFormat {
        found: String,
    },
    Bad {
        key: &'static str,
        value: String,
        why: String,
    },
}

/// A file's `__metadata__`, read by key.
pub(crate) struct FileMeta<'a>(pub Option<&'a std::collections::HashMap<String, String>>);

impl<'a> FileMeta<'a> {
    pub fn get(&self, key: &'static str) -> Result<&'a String, MetaProblem> {
        self.0
            .and_then(|m| m.get(key))
            .ok_or(MetaProblem::Missing { key })
    }

    /// Checks that `key` names the format `expected`.
    pub fn format(&self, key: &'static str, expected: &str) -> Result<(), MetaProblem> {
        let found = self.get(key)?;
        if found != expected {
            return Err(MetaProblem::UnknownFormat {
                found: found.clone(),
            });
        }
        Ok(())
    }

    /// The scheme `key` holds, and its text as written.
    pub fn scheme(
        &self,
        key: &'static str,
    ) -> Result<(kvq_spec::SchemeSpec, &'a String), MetaProblem> {
        let text = self.get(key)?;
        let spec = kvq_spec::SchemeSpec::parse(text).map_err(|e| MetaProblem::Bad {
            key,
            value: text.clone(),
            why: format!("not a valid scheme: {e}"),
        })?;
        Ok((spec, text))
    }

    /// The count `key` holds (decimal).
    pub fn count(&self, key: &'static str) -> Result<usize, MetaProblem> {
        let value = self.get(key)?;
        value.parse().map_err(|e| MetaProblem::Bad {
            key,
            value: value.clone(),
            why: format!("not a count: {e}"),
        })
    }
}
