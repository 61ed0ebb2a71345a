//! Resources are checked before they are taken: memory a user-given size asks for, and the files a
//! user names.
//!
//! - [`check`] turns a size computed with checked arithmetic into bytes the machine can give: an
//!   overflow, or more than the memory available (`MemAvailable` in `/proc/meminfo` on Linux; no
//!   bound where that is unknown), is an [`AllocError`] naming the size and what asked for it.
//! - [`try_vec`] and [`try_with_capacity`] then take the memory with `Vec::try_reserve_exact`, so a
//!   refusal by the allocator is an error too, never an abort.
//! - [`read_input_file`] reads a file with its size known: a directory, FIFO, device node or socket
//!   is refused before it is opened (reading `/dev/zero` would never end), and so is a file larger
//!   than the caller's bound or the memory available.

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

/// A size the machine cannot give.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct AllocError {
    /// What asked for the memory, e.g. "the synthetic layer's input (100000000 tokens × 256)".
    pub what: String,
    /// Bytes asked for; `None` when the size overflows 64 bits.
    pub bytes: Option<u64>,
    /// Bytes the machine had available when it was asked, where known.
    pub available: Option<u64>,
}

impl AllocError {
    /// A request whose size does not fit 64 bits (or `usize`): `what` names it.
    pub fn overflow(what: impl Into<String>) -> Self {
        AllocError {
            what: what.into(),
            bytes: None,
            available: None,
        }
    }
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.bytes, self.available) {
            (None, _) => write!(
                f,
                "{} would need more than 2^64 bytes of memory (the size overflows)",
                self.what
            ),
            (Some(b), Some(a)) if b > a && memory_limit() == Some(a) => write!(
                f,
                "{} needs {} ({b} bytes) of memory, more than this process's limit of {} \
                 (resources::set_memory_limit)",
                self.what,
                human_bytes(b),
                human_bytes(a)
            ),
            (Some(b), Some(a)) if b > a => write!(
                f,
                "{} needs {} ({b} bytes) of memory, more than the {} this machine has available",
                self.what,
                human_bytes(b),
                human_bytes(a)
            ),
            (Some(b), _) => write!(
                f,
                "{} needs {} ({b} bytes) of memory, and the allocator refused it",
                self.what,
                human_bytes(b)
            ),
        }
    }
}

/// `1234567` → `"1.2 MB"` (decimal units, as `df -H` and disk vendors count).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["bytes", "kB", "MB", "GB", "TB", "PB", "EB"];
    if bytes < 1000 {
        return format!("{bytes} bytes");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// `count` elements of `T` in bytes, or `None` on overflow.
pub fn bytes_of<T>(count: usize) -> Option<u64> {
    (count as u64).checked_mul(std::mem::size_of::<T>() as u64)
}

/// The product of `dims`, or `None` on overflow.
pub fn product(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

/// A process-wide bound on any one request, below what the machine has (0: none). An engine that
/// shares the host with other work, or a fuzzer, sets it so that a scheme whose fixed buffers are
/// huge (a 2^20-token page or window) is an error rather than gigabytes taken for one token.
static LIMIT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Bounds every later request checked here (by [`check`], [`try_with_capacity`], [`try_vec`],
/// [`read_input_file`]) to `bytes`, or lifts the bound with `None`.
pub fn set_memory_limit(bytes: Option<u64>) {
    LIMIT.store(bytes.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
}

/// The bound set by [`set_memory_limit`], if any.
pub fn memory_limit() -> Option<u64> {
    match LIMIT.load(std::sync::atomic::Ordering::Relaxed) {
        0 => None,
        b => Some(b),
    }
}

/// Memory a request may take now: `MemAvailable` on Linux (`None` where unknown), lowered to the
/// bound of [`set_memory_limit`].
pub fn available_memory() -> Option<u64> {
    match (machine_available_memory(), memory_limit()) {
        (Some(a), Some(l)) => Some(a.min(l)),
        (a, l) => a.or(l),
    }
}

/// Memory the machine can give now: `MemAvailable` on Linux, `None` where unknown.
fn machine_available_memory() -> Option<u64> {
    // /proc/meminfo is a few hundred bytes of procfs text, not user input.
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut parts = line.split_whitespace().skip(1);
    let value: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") => value.checked_mul(1024),
        None => Some(value),
        Some(_) => None,
    }
}

/// Whether `bytes` (a size computed with checked arithmetic; `None` = it overflowed) fits in the
/// memory available: the bytes, or an [`AllocError`] naming `what`.
pub fn check(bytes: Option<u64>, what: &str) -> Result<u64, AllocError> {
    check_against(bytes, available_memory(), what)
}

/// [`check`] against a given amount of available memory (`None`: unknown, no bound).
pub fn check_against(
    bytes: Option<u64>,
    available: Option<u64>,
    what: &str,
) -> Result<u64, AllocError> {
    let err = |bytes| AllocError {
        what: what.to_string(),
        bytes,
        available,
    };
    let b = bytes.ok_or_else(|| err(None))?;
    // No allocation may exceed isize::MAX bytes, whatever the machine has.
    if b > isize::MAX as u64 || available.is_some_and(|a| b > a) {
        return Err(err(Some(b)));
    }
    Ok(b)
}

/// An empty vector with room for exactly `count` elements, checked with [`check`] and reserved
/// with `try_reserve_exact`.
pub fn try_with_capacity<T>(count: usize, what: &str) -> Result<Vec<T>, AllocError> {
    let bytes = check(bytes_of::<T>(count), what)?;
    let mut v = Vec::new();
    v.try_reserve_exact(count).map_err(|_| AllocError {
        what: what.to_string(),
        bytes: Some(bytes),
        available: available_memory(),
    })?;
    Ok(v)
}

/// A tensor of shape `dims` filled with `value`: the element count is multiplied out checked,
/// then allocated as [`try_vec`] does.
pub fn try_vec_of<T: Clone>(dims: &[usize], value: T, what: &str) -> Result<Vec<T>, AllocError> {
    let count = product(dims).ok_or_else(|| AllocError::overflow(what))?;
    try_vec(count, value, what)
}

/// `count` copies of `value`, allocated as [`try_with_capacity`] does.
pub fn try_vec<T: Clone>(count: usize, value: T, what: &str) -> Result<Vec<T>, AllocError> {
    let mut v = try_with_capacity(count, what)?;
    v.resize(count, value);
    Ok(v)
}

/// Why a user's file could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {why}", path.display())]
pub struct FileError {
    /// The file as named.
    pub path: PathBuf,
    /// What is wrong with it, in a sentence.
    pub why: String,
    /// Whether the file does not exist (callers with a default file treat that as empty).
    pub not_found: bool,
}

/// What a path is when it is not a regular file, for the message.
fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    "not a regular file"
}

/// Reads the regular file `path` whole, with its size known before anything is allocated: a
/// directory, FIFO, device node or socket is refused (without opening it: opening a FIFO blocks),
/// and so is a file larger than `limit` bytes or than the memory available. `what` names the file's
/// role in messages ("the K/V file").
pub fn read_input_file(path: &Path, what: &str, limit: u64) -> Result<Vec<u8>, FileError> {
    let fail = |why: String| FileError {
        path: path.to_path_buf(),
        why,
        not_found: false,
    };
    let meta = std::fs::metadata(path).map_err(|e| FileError {
        path: path.to_path_buf(),
        why: format!("cannot read {what}: {e}"),
        not_found: e.kind() == std::io::ErrorKind::NotFound,
    })?;
    if !meta.is_file() {
        return Err(fail(format!(
            "{what} must be a regular file, and this is {}",
            kind_of(&meta)
        )));
    }
    let mut file =
        std::fs::File::open(path).map_err(|e| fail(format!("cannot open {what}: {e}")))?;
    // Stat the opened handle too: the path may have been replaced since the first look.
    let meta = file
        .metadata()
        .map_err(|e| fail(format!("cannot read {what}: {e}")))?;
    if !meta.is_file() {
        return Err(fail(format!(
            "{what} must be a regular file, and this is {}",
            kind_of(&meta)
        )));
    }
    let size = meta.len();
    if size > limit {
        return Err(fail(format!(
            "{what} is {} ({size} bytes), more than the {} ({limit} bytes) kvq reads",
            human_bytes(size),
            human_bytes(limit)
        )));
    }
    let count = usize::try_from(size).unwrap_or(usize::MAX);
    let mut bytes = try_with_capacity::<u8>(count, &format!("reading {what}"))
        .map_err(|e| fail(e.to_string()))?;
    // One byte past the stated size tells a file that grew while it was read from a whole one.
    (&mut file)
        .take(size.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| fail(format!("cannot read {what}: {e}")))?;
    if bytes.len() as u64 != size {
        return Err(fail(format!(
            "{what} changed while it was read (its size was {size} bytes, {} were read)",
            bytes.len()
        )));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_past_the_machine_or_past_64_bits_are_errors_naming_the_bytes() {
        let e =
            check_against(Some(102_400_000_000), Some(20_000_000_000), "the layer").unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("the layer needs 102.4 GB (102400000000 bytes)") && s.contains("20.0 GB"),
            "{s}"
        );
        let e = check_against(None, None, "the layer").unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
        assert_eq!(check_against(Some(10), Some(100), "x"), Ok(10));
        assert_eq!(check_against(Some(10), None, "x"), Ok(10));
        assert!(check_against(Some(u64::MAX), None, "x").is_err());
        assert_eq!(product(&[1 << 40, 1 << 40]), None);
        assert_eq!(bytes_of::<f32>(usize::MAX), None);
        // Beyond any machine: refused, not aborted.
        let e = try_vec(usize::MAX / 4, 0.0f32, "a huge tensor").unwrap_err();
        assert!(e.to_string().contains("a huge tensor"), "{e}");
        assert_eq!(try_vec(3, 1u8, "small").unwrap(), vec![1, 1, 1]);
    }

    #[test]
    fn memory_available_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(available_memory().is_some_and(|m| m > 0));
        }
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_bytes(999), "999 bytes");
        assert_eq!(human_bytes(102_400_000_000), "102.4 GB");
    }

    #[test]
    fn device_nodes_directories_and_large_files_are_refused_without_reading() {
        let dir = std::env::temp_dir().join(format!("kvq-resources-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = read_input_file(&dir, "the K/V file", 1 << 20).unwrap_err();
        assert!(e.why.contains("a directory"), "{e}");
        #[cfg(unix)]
        {
            let e = read_input_file(Path::new("/dev/zero"), "the K/V file", u64::MAX).unwrap_err();
            assert!(e.why.contains("a character device"), "{e}");
        }
        let f = dir.join("ten.bin");
        std::fs::write(&f, [7u8; 10]).unwrap();
        assert_eq!(read_input_file(&f, "x", 10).unwrap(), vec![7u8; 10]);
        let e = read_input_file(&f, "the tuning file", 9).unwrap_err();
        assert!(
            e.why.contains("10 bytes") && e.why.contains("9 bytes"),
            "{e}"
        );
        let e = read_input_file(&dir.join("missing"), "the K/V file", 9).unwrap_err();
        assert!(
            e.not_found && e.why.contains("cannot read the K/V file"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
