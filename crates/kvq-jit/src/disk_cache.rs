//! Compiled modules on disk, so a second process start compiles nothing.
//!
//! **Key.** SHA-256 over (source name, code and in-memory headers; the resolved NVRTC arguments,
//! which include the architecture, the C++ dialect, defines and include folders; the output kind;
//! the NVRTC version), each field length-prefixed. Any change to any of them is a different entry.
//! (The key does not see the *contents* of headers read from include folders: those change with
//! the toolkit, i.e. with the NVRTC version, which is in the key.)
//!
//! **Where.** `$KVQ_CACHE_DIR/modules/`, else `<user cache dir>/kvq/modules/` (`~/.cache/kvq` on
//! Linux, honouring `XDG_CACHE_HOME`). [`cache_root`] is shared with the autotuner's files.
//!
//! **Entries.** `<key>.<ptx|cubin>`: a magic line, one line of JSON ([`EntryHeader`]: what was
//! compiled, how, and the payload's length and SHA-256), then the image. Writes go to a
//! temporary file in the same folder and are renamed into place, so readers never see half an
//! entry and concurrent writers of the same key are harmless. An entry that is unreadable,
//! truncated, altered or for another key is counted as corrupt, deleted and recompiled — never
//! an error. Failing to *write* an entry is not fatal either: it is counted and reported once on
//! stderr, and the compiled module is still returned.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use kvq_reference::resources::read_input_file;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::arch::Arch;
use crate::error::{JitError, Result};
use crate::nvrtc::{self, CompileOptions, Compiled, NvrtcVersion, Output, ResolvedOptions, Source};

/// The environment variable that overrides the cache folder.
pub const KVQ_CACHE_DIR: &str = "KVQ_CACHE_DIR";

const MAGIC: &[u8] = b"KVQ-MODULE 1\n";

/// The largest entry read. A decode kernel's cubin or PTX is well under a megabyte and the
/// biggest module kvq compiles a few megabytes, so 256 MiB is far past any real entry while a
/// stray huge file at an entry's path is refused before it is read into memory.
pub const MAX_ENTRY_BYTES: u64 = 256 << 20;
const KEY_DOMAIN: &[u8] = b"kvq-runtime module cache v1";

/// kvq's cache folder: `$KVQ_CACHE_DIR` if set and non-empty, else `<user cache dir>/kvq`.
/// Not created here.
pub fn cache_root() -> Result<PathBuf> {
    match std::env::var_os(KVQ_CACHE_DIR) {
        Some(dir) if !dir.is_empty() => Ok(PathBuf::from(dir)),
        _ => dirs::cache_dir()
            .map(|d| d.join("kvq"))
            .ok_or(JitError::NoCacheDir),
    }
}

/// Where a compile came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Origin {
    /// NVRTC ran.
    Compiled,
    /// Read from the disk cache.
    DiskCache,
    /// Already loaded in this process.
    Memory,
}

/// The cache key of one compile: 64 hex digits of SHA-256.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CacheKey(String);

impl CacheKey {
    /// The key of compiling `source` with `options` to `output` with NVRTC `nvrtc`.
    pub fn new(
        source: &Source,
        options: &ResolvedOptions,
        output: Output,
        nvrtc: NvrtcVersion,
    ) -> CacheKey {
        let mut h = Sha256::new();
        let mut field = |bytes: &[u8]| {
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        field(KEY_DOMAIN);
        field(source.name.as_bytes());
        field(source.code.as_bytes());
        field(&(source.headers.len() as u64).to_le_bytes());
        for header in &source.headers {
            field(header.name.as_bytes());
            field(header.contents.as_bytes());
        }
        field(&(options.args.len() as u64).to_le_bytes());
        for arg in &options.args {
            field(arg.as_bytes());
        }
        field(options.arch.to_string().as_bytes());
        field(output.extension().as_bytes());
        field(nvrtc.to_string().as_bytes());
        CacheKey(hex(&h.finalize()))
    }

    /// The hex digest.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for CacheKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The JSON line at the start of each entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryHeader {
    /// The entry's key (checked on read).
    pub key: String,
    /// The source's name.
    pub source_name: String,
    /// PTX or CUBIN.
    pub output: Output,
    /// Target architecture.
    pub arch: Arch,
    /// The NVRTC that compiled it.
    pub nvrtc: NvrtcVersion,
    /// NVRTC's arguments.
    pub options: Vec<String>,
    /// Image length in bytes.
    pub payload_len: u64,
    /// SHA-256 of the image, hex.
    pub payload_sha256: String,
    /// When it was written, seconds since the Unix epoch.
    pub created_unix_s: u64,
}

/// Counters of one [`DiskCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheStats {
    /// Lookups answered from disk.
    pub hits: u64,
    /// Lookups that had to compile (including corrupt entries).
    pub misses: u64,
    /// Entries found unreadable or damaged (and recompiled).
    pub corrupt: u64,
    /// Entries that could not be written.
    pub write_errors: u64,
}

impl std::fmt::Display for CacheStats {
    /// `compiled 0 modules (3 cache hits)`, plus corrupt entries and write errors when any.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let plural = |n: u64| if n == 1 { "" } else { "s" };
        write!(
            f,
            "compiled {} module{} ({} cache hit{}",
            self.misses,
            plural(self.misses),
            self.hits,
            plural(self.hits)
        )?;
        if self.corrupt > 0 {
            write!(
                f,
                ", {} corrupt entr{} replaced",
                self.corrupt,
                if self.corrupt == 1 { "y" } else { "ies" }
            )?;
        }
        if self.write_errors > 0 {
            write!(
                f,
                ", {} write error{}",
                self.write_errors,
                plural(self.write_errors)
            )?;
        }
        write!(f, ")")
    }
}

/// A folder of compiled modules. Thread-safe; several processes may share one folder.
#[derive(Debug)]
pub struct DiskCache {
    dir: PathBuf,
    hits: AtomicU64,
    misses: AtomicU64,
    corrupt: AtomicU64,
    write_errors: AtomicU64,
    warned: AtomicBool,
    read_warned: AtomicBool,
    note: std::sync::Mutex<Option<String>>,
}

impl DiskCache {
    /// The cache under [`cache_root`]`/modules`, created if missing.
    pub fn from_env() -> Result<DiskCache> {
        DiskCache::open(cache_root()?.join("modules"))
    }

    /// The cache in `dir`, created if missing.
    pub fn open(dir: impl Into<PathBuf>) -> Result<DiskCache> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(|source| JitError::CacheIo {
            action: "create the cache directory",
            path: dir.clone(),
            source,
        })?;
        Ok(DiskCache {
            dir,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
            write_errors: AtomicU64::new(0),
            warned: AtomicBool::new(false),
            read_warned: AtomicBool::new(false),
            note: std::sync::Mutex::new(None),
        })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of `key`'s entry.
    pub fn entry_path(&self, key: &CacheKey, output: Output) -> PathBuf {
        self.dir.join(format!("{key}.{}", output.extension()))
    }

    /// The counters so far.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            corrupt: self.corrupt.load(Ordering::Relaxed),
            write_errors: self.write_errors.load(Ordering::Relaxed),
        }
    }

    /// Compiles `source` for `arch` through the cache: NVRTC runs only on a miss.
    pub fn compile(
        &self,
        source: &Source,
        arch: Arch,
        output: Output,
        options: &CompileOptions,
    ) -> Result<(Compiled, Origin)> {
        let resolved = options.resolve(arch);
        let key = CacheKey::new(source, &resolved, output, nvrtc::version()?);
        self.get_or_compile(&key, output, &source.name, || {
            nvrtc::compile_resolved(source, output, &resolved)
        })
    }

    /// The entry of `key`, or the result of `compile` (stored before it is returned).
    pub fn get_or_compile(
        &self,
        key: &CacheKey,
        output: Output,
        source_name: &str,
        compile: impl FnOnce() -> Result<Compiled>,
    ) -> Result<(Compiled, Origin)> {
        if let Some(found) = self.read(key, output) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok((found, Origin::DiskCache));
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let compiled = compile()?;
        if let Err(e) = self.write(key, source_name, &compiled) {
            self.write_errors.fetch_add(1, Ordering::Relaxed);
            if !self.warned.swap(true, Ordering::Relaxed) {
                eprintln!("kvq: warning: compiled modules will not be cached: {e}");
            }
        }
        Ok((compiled, Origin::Compiled))
    }

    /// Why the last entry that could not be read was passed over (a FIFO, device node or
    /// directory at its path, a file past [`MAX_ENTRY_BYTES`], a permission error), if one was.
    pub fn note(&self) -> Option<String> {
        self.note.lock().map_or(None, |n| n.clone())
    }

    /// Reads and checks an entry; `None` when absent or damaged (damaged ones are counted and
    /// removed).
    ///
    /// The read goes through [`read_input_file`]: a path that is not a regular file is never
    /// opened (opening a FIFO blocks until a writer comes) and a file's size is checked before
    /// it is read, so such an entry is a counted miss with a [`DiskCache::note`] (and one warning
    /// on stderr), and the compiled module replaces it.
    pub fn read(&self, key: &CacheKey, output: Output) -> Option<Compiled> {
        let path = self.entry_path(key, output);
        let bytes = match read_input_file(&path, "the cache entry", MAX_ENTRY_BYTES) {
            Ok(b) => b,
            Err(e) if e.not_found => return None,
            Err(e) => {
                self.corrupt.fetch_add(1, Ordering::Relaxed);
                let note = format!("ignoring the compiled-module cache entry {e}");
                if !self.read_warned.swap(true, Ordering::Relaxed) {
                    eprintln!("kvq: warning: {note}; the module is compiled again");
                }
                if let Ok(mut slot) = self.note.lock() {
                    *slot = Some(note);
                }
                return None;
            }
        };
        match parse_entry(&bytes, key, output) {
            Some(compiled) => Some(compiled),
            None => {
                self.corrupt.fetch_add(1, Ordering::Relaxed);
                let _ = fs::remove_file(&path);
                None
            }
        }
    }

    /// Writes an entry atomically (temporary file, then rename).
    pub fn write(&self, key: &CacheKey, source_name: &str, compiled: &Compiled) -> Result<PathBuf> {
        let path = self.entry_path(key, compiled.output);
        let header = EntryHeader {
            key: key.as_str().to_string(),
            source_name: source_name.to_string(),
            output: compiled.output,
            arch: compiled.arch,
            nvrtc: compiled.nvrtc,
            options: compiled.options.clone(),
            payload_len: compiled.image.len() as u64,
            payload_sha256: hex(&Sha256::digest(&compiled.image)),
            created_unix_s: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        };
        let json = serde_json::to_string(&header).map_err(|e| JitError::CacheIo {
            action: "encode the entry header for",
            path: path.clone(),
            source: std::io::Error::other(e),
        })?;
        let mut bytes = Vec::with_capacity(MAGIC.len() + json.len() + 1 + compiled.image.len());
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(json.as_bytes());
        bytes.push(b'\n');
        bytes.extend_from_slice(&compiled.image);
        write_atomically(&path, &bytes)?;
        Ok(path)
    }

    /// Deletes every entry; returns how many.
    pub fn clear(&self) -> Result<usize> {
        let io = |source| JitError::CacheIo {
            action: "list",
            path: self.dir.clone(),
            source,
        };
        let mut removed = 0;
        for entry in fs::read_dir(&self.dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            let is_entry = matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("ptx") | Some("cubin") | Some("tmp")
            );
            if is_entry && fs::remove_file(&path).is_ok() {
                removed += 1;
            }
        }
        Ok(removed)
    }
}

fn parse_entry(bytes: &[u8], key: &CacheKey, output: Output) -> Option<Compiled> {
    let rest = bytes.strip_prefix(MAGIC)?;
    let newline = rest.iter().position(|&b| b == b'\n')?;
    let header: EntryHeader = serde_json::from_slice(&rest[..newline]).ok()?;
    let payload = &rest[newline + 1..];
    let valid = header.key == key.as_str()
        && header.output == output
        && header.payload_len == payload.len() as u64
        && header.payload_sha256 == hex(&Sha256::digest(payload));
    valid.then(|| Compiled {
        output: header.output,
        arch: header.arch,
        nvrtc: header.nvrtc,
        options: header.options,
        image: payload.to_vec(),
        log: String::new(),
    })
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().unwrap_or(Path::new("."));
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(
        ".{file_name}.{}.{}.tmp",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| -> std::io::Result<()> {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)
    })();
    result.map_err(|source| {
        let _ = fs::remove_file(&tmp);
        JitError::CacheIo {
            action: "write the cache entry",
            path: path.to_path_buf(),
            source,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvrtc::IncludeDirs;

    fn temp_cache(tag: &str) -> DiskCache {
        let dir =
            std::env::temp_dir().join(format!("kvq-disk-cache-unit-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        DiskCache::open(dir).unwrap()
    }

    fn fake(image: &[u8]) -> Compiled {
        Compiled {
            output: Output::Cubin,
            arch: Arch::SM_80,
            nvrtc: NvrtcVersion {
                major: 13,
                minor: 0,
            },
            options: vec!["--std=c++17".into()],
            image: image.to_vec(),
            log: String::new(),
        }
    }

    fn key(code: &str, opts: &CompileOptions) -> CacheKey {
        let src = Source::new("k.cu", code);
        CacheKey::new(
            &src,
            &opts.resolve(Arch::SM_80),
            Output::Cubin,
            NvrtcVersion {
                major: 13,
                minor: 0,
            },
        )
    }

    #[test]
    fn keys_change_with_every_input() {
        let opts = CompileOptions::default().include_dirs(IncludeDirs::None);
        let base = key("a", &opts);
        assert_eq!(base, key("a", &opts));
        assert_eq!(base.as_str().len(), 64);
        assert_ne!(base, key("b", &opts));
        assert_ne!(base, key("a", &opts.clone().fast_math(true)));
        let src = Source::new("k.cu", "a");
        let r = opts.resolve(Arch::SM_80);
        let v13 = NvrtcVersion {
            major: 13,
            minor: 0,
        };
        assert_ne!(base, CacheKey::new(&src, &r, Output::Ptx, v13));
        assert_ne!(
            base,
            CacheKey::new(
                &src,
                &r,
                Output::Cubin,
                NvrtcVersion {
                    major: 13,
                    minor: 1
                }
            )
        );
        assert_ne!(
            base,
            CacheKey::new(&src, &opts.resolve(Arch::SM_90A), Output::Cubin, v13)
        );
        assert_ne!(
            base,
            CacheKey::new(
                &src.clone().with_header("h.cuh", "x"),
                &r,
                Output::Cubin,
                v13
            )
        );
    }

    #[test]
    fn hit_miss_and_corruption_without_nvrtc() {
        let cache = temp_cache("fake");
        let opts = CompileOptions::default().include_dirs(IncludeDirs::None);
        let k = key("fake", &opts);
        let (c, origin) = cache
            .get_or_compile(&k, Output::Cubin, "k.cu", || Ok(fake(b"image")))
            .unwrap();
        assert_eq!(
            (origin, c.image.as_slice()),
            (Origin::Compiled, &b"image"[..])
        );
        let (c, origin) = cache
            .get_or_compile(&k, Output::Cubin, "k.cu", || {
                panic!("must not compile on a hit")
            })
            .unwrap();
        assert_eq!(
            (origin, c.image.as_slice()),
            (Origin::DiskCache, &b"image"[..])
        );

        // Flip one payload byte: detected, removed, recompiled.
        let path = cache.entry_path(&k, Output::Cubin);
        let mut bytes = fs::read(&path).unwrap();
        *bytes.last_mut().unwrap() ^= 0xff;
        fs::write(&path, &bytes).unwrap();
        let (_, origin) = cache
            .get_or_compile(&k, Output::Cubin, "k.cu", || Ok(fake(b"image")))
            .unwrap();
        assert_eq!(origin, Origin::Compiled);

        // Truncated and garbage files too.
        for junk in [&b""[..], b"KVQ-MODULE 1\n{not json\n", b"garbage"] {
            fs::write(&path, junk).unwrap();
            let (_, origin) = cache
                .get_or_compile(&k, Output::Cubin, "k.cu", || Ok(fake(b"image")))
                .unwrap();
            assert_eq!(origin, Origin::Compiled);
        }
        let s = cache.stats();
        assert_eq!((s.hits, s.misses, s.corrupt, s.write_errors), (1, 5, 4, 0));
        assert_eq!(
            s.to_string(),
            "compiled 5 modules (1 cache hit, 4 corrupt entries replaced)"
        );
        // No temporary files left behind.
        let leftovers: Vec<_> = fs::read_dir(cache.dir())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty());
        assert_eq!(cache.clear().unwrap(), 1);
        let _ = fs::remove_dir_all(cache.dir());
    }

    #[cfg(unix)]
    #[test]
    fn a_fifo_device_or_oversized_entry_is_a_miss_with_a_note_never_a_hang() {
        // A lookup that blocked on the FIFO would hang the test run: each one runs on a thread
        // the test waits for at most 10 s.
        fn promptly<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || tx.send(f()));
            rx.recv_timeout(std::time::Duration::from_secs(10))
                .expect("a cache lookup blocked for 10 s")
        }
        // Nothing ever writes to it, so opening it to read would block forever.
        fn make_fifo(path: &Path) {
            use std::os::unix::ffi::OsStrExt;
            let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
            // SAFETY: `c` is a NUL-terminated path alive through the call.
            assert_eq!(
                unsafe { libc::mkfifo(c.as_ptr(), 0o600) },
                0,
                "{}",
                path.display()
            );
        }
        let cache = std::sync::Arc::new(temp_cache("special"));
        let opts = CompileOptions::default().include_dirs(IncludeDirs::None);
        let k = key("special", &opts);
        let path = cache.entry_path(&k, Output::Cubin);
        let compile_through = |cache: &std::sync::Arc<DiskCache>| {
            let (cache, k) = (cache.clone(), k.clone());
            promptly(move || {
                cache
                    .get_or_compile(&k, Output::Cubin, "k.cu", || Ok(fake(b"image")))
                    .map(|(c, origin)| (c.image, origin))
            })
            .unwrap()
        };

        make_fifo(&path);
        assert_eq!(
            compile_through(&cache),
            (b"image".to_vec(), Origin::Compiled)
        );
        let note = cache.note().unwrap_or_default();
        assert!(
            note.contains("a FIFO") && note.contains(&path.display().to_string()),
            "{note}"
        );
        // The compiled module replaced the FIFO: the next lookup is a hit.
        assert_eq!(
            compile_through(&cache),
            (b"image".to_vec(), Origin::DiskCache)
        );

        fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        assert_eq!(compile_through(&cache).1, Origin::Compiled);
        let note = cache.note().unwrap_or_default();
        assert!(note.contains("a character device"), "{note}");

        // Sparse: only the stated size is past the limit.
        fs::remove_file(&path).unwrap();
        fs::File::create(&path)
            .unwrap()
            .set_len(MAX_ENTRY_BYTES + 1)
            .unwrap();
        assert_eq!(compile_through(&cache).1, Origin::Compiled);
        let note = cache.note().unwrap_or_default();
        assert!(
            note.contains(&format!("{} bytes", MAX_ENTRY_BYTES + 1)),
            "{note}"
        );
        let s = cache.stats();
        assert_eq!((s.hits, s.misses, s.corrupt), (1, 3, 3));
        let _ = fs::remove_dir_all(cache.dir());
    }

    #[test]
    fn compile_errors_are_not_cached() {
        let cache = temp_cache("err");
        let k = key(
            "err",
            &CompileOptions::default().include_dirs(IncludeDirs::None),
        );
        let e = cache
            .get_or_compile(&k, Output::Cubin, "k.cu", || {
                Err(JitError::InvalidInput("x".into()))
            })
            .unwrap_err();
        assert!(matches!(e, JitError::InvalidInput(_)));
        assert!(!cache.entry_path(&k, Output::Cubin).exists());
        let _ = fs::remove_dir_all(cache.dir());
    }

    #[test]
    fn unwritable_cache_is_not_fatal() {
        let cache = temp_cache("ro");
        let k = key(
            "ro",
            &CompileOptions::default().include_dirs(IncludeDirs::None),
        );
        // Make the entry path a directory, so the rename onto it fails.
        fs::create_dir_all(cache.entry_path(&k, Output::Cubin).join("blocker")).unwrap();
        let (c, origin) = cache
            .get_or_compile(&k, Output::Cubin, "k.cu", || Ok(fake(b"x")))
            .unwrap();
        assert_eq!((origin, c.image.as_slice()), (Origin::Compiled, &b"x"[..]));
        assert_eq!(cache.stats().write_errors, 1);
        let _ = fs::remove_dir_all(cache.dir());
    }
}
