//! The persistent tuning results: one JSON file (`<cache dir>/tune.json`) of the tuner's results,
//! decode launches ([`TuneEntry`]) and page-quantizer forms ([`FormsEntry`]), each keyed by GPU
//! and problem, and the problem key by a checksum of the candidate set the result was chosen from
//! (a changed candidate set misses its old results instead of reading them).
//!
//! The file is a cache of measurements, so nothing about it may stop a program: a missing file is
//! empty, a damaged or foreign one is ignored with a warning (and replaced at the next save), and
//! an entry whose configuration no longer validates is skipped. Saves re-read the file and merge,
//! so processes tuning different shapes at once lose nothing but a simultaneous result for the
//! same key; the write is atomic (temporary file in the same folder, then rename).

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use kvq_reference::resources::read_input_file;
use serde::{Deserialize, Serialize};

use super::choice::TuneChoice;
use super::key::{GpuKey, ProblemKey};
use crate::disk_cache::cache_root;
use crate::error::{Result, RuntimeError};
use crate::paged::{FormsEntry, FormsKey};

/// Name of the file under the cache root.
pub const TUNE_FILE: &str = "tune.json";
/// Marker in the file, so an unrelated `tune.json` is recognised as such.
pub const FORMAT: &str = "kvq-tune";
/// Layout version of the file; other versions are ignored (and replaced at the next save).
/// Version 3 keys every result by a checksum of its candidate set and holds the quantizer forms'
/// results too (`forms`); version 2 added `min_warps_per_sm` to the choice.
pub const VERSION: u32 = 3;

/// FNV-1a of `bytes` as 16 hex digits: the checksum of a candidate set.
pub fn checksum(bytes: &[u8]) -> String {
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{h:016x}")
}

/// A result the store holds, keyed by GPU and problem: a decode launch ([`TuneEntry`]) or the
/// forms of a scheme's page quantizers ([`FormsEntry`]).
pub trait Stored: Clone {
    /// What the result was measured for (including the candidate set's checksum).
    type Key: PartialEq + fmt::Display;
    /// Where it was measured.
    fn gpu(&self) -> &GpuKey;
    /// What it was measured for.
    fn key(&self) -> &Self::Key;
    /// Whether this kvq can still use it (entries written by another version may name
    /// parameters this one no longer declares).
    fn check(&self) -> std::result::Result<(), String>;
}

impl Stored for TuneEntry {
    type Key = ProblemKey;
    fn gpu(&self) -> &GpuKey {
        &self.gpu
    }
    fn key(&self) -> &ProblemKey {
        &self.problem
    }
    fn check(&self) -> std::result::Result<(), String> {
        if let Some(x) = &self.xquant {
            // An XQuant launch: only the split count is chosen (the kernel's shape is the code
            // generator's); the launch takes 1 to XQUANT_MAX_SPLITS.
            let most = crate::xquant::XQUANT_MAX_SPLITS;
            return if self.codebook.is_some() {
                Err("an XQuant launch with a codebook launch shape".into())
            } else if x.rank == 0 || !(1..=most).contains(&self.choice.splits) {
                Err(format!(
                    "an XQuant launch of {} splits (1 to {most}) over latents of {}",
                    self.choice.splits, x.rank
                ))
            } else {
                Ok(())
            };
        }
        match &self.codebook {
            // A codebook launch: its own parameters (the decode templates' do not apply); the
            // kernel generator refuses any the problem's shape cannot take when it is loaded.
            Some(p) if p.threads % 32 == 0 && (32..=1024).contains(&p.threads) && p.tile > 0 => {
                if self.choice.splits >= 1 {
                    Ok(())
                } else {
                    Err("a codebook launch of no splits".into())
                }
            }
            Some(p) => Err(format!(
                "a codebook launch of {} threads, tile {}",
                p.threads, p.tile
            )),
            None => self.choice.check().map_err(|e| e.to_string()),
        }
    }
}

impl Stored for FormsEntry {
    type Key = FormsKey;
    fn gpu(&self) -> &GpuKey {
        &self.gpu
    }
    fn key(&self) -> &FormsKey {
        &self.problem
    }
    fn check(&self) -> std::result::Result<(), String> {
        Ok(())
    }
}

/// The entry of `list` for `gpu` and `key` that still checks (a warning names one that does not).
fn lookup_in<'a, T: Stored>(
    list: &'a [T],
    gpu: &GpuKey,
    key: &T::Key,
    path: &Path,
) -> Option<&'a T> {
    let entry = list.iter().find(|e| e.gpu() == gpu && e.key() == key)?;
    match entry.check() {
        Ok(()) => Some(entry),
        Err(e) => {
            warn(&format!(
                "ignoring the stored tuning result for {key} in {}: {e}",
                path.display()
            ));
            None
        }
    }
}

/// `list` with `entry` in place of any entry of the same GPU and key.
fn insert_in<T: Stored>(list: &mut Vec<T>, entry: T) {
    list.retain(|e| !(e.gpu() == entry.gpu() && e.key() == entry.key()));
    list.push(entry);
}

/// `old` without the keys `new` has, then `new`.
fn merged<T: Stored>(mut old: Vec<T>, new: &[T]) -> Vec<T> {
    old.retain(|o| !new.iter().any(|e| e.gpu() == o.gpu() && e.key() == o.key()));
    old.extend(new.iter().cloned());
    old
}

/// One measured result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TuneEntry {
    /// Where it was measured.
    pub gpu: GpuKey,
    /// What it was measured for.
    pub problem: ProblemKey,
    /// The scheme's canonical text (for people reading the file; matching uses the hash).
    pub scheme: String,
    /// The fastest configuration that passed the correctness check.
    pub choice: TuneChoice,
    /// Median time of `choice`, µs.
    pub tuned_us: f64,
    /// Median time of the heuristic default in the same session, µs.
    pub default_us: f64,
    /// Batch size and longest sequence actually timed (inside the key's buckets).
    pub measured_batch: usize,
    /// See `measured_batch`.
    pub measured_len: usize,
    /// Configurations timed.
    pub candidates: usize,
    /// Configurations discarded by the correctness check.
    pub rejected: usize,
    /// When, in seconds since the Unix epoch.
    pub tuned_at_unix: u64,
    /// The kvq-runtime version that measured it.
    pub kvq_version: String,
    /// A codebook scheme's launch shape (`choice` then holds its threads, tile and splits); absent
    /// for the integer schemes and in files written before codebook tuning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub codebook: Option<kvq_codegen::CodebookParams>,
    /// An XQuant scheme's launch (`choice` then holds its decode's threads, tile and the tuned
    /// splits): the latent width and rebuild it was measured with; absent for the other schemes
    /// and in files written before XQuant tuning (which ignore it: its key matches no other
    /// scheme's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xquant: Option<crate::xquant::XQuantTuned>,
}

impl TuneEntry {
    /// Whether this entry answers for `gpu` and `problem`.
    pub fn matches(&self, gpu: &GpuKey, problem: &ProblemKey) -> bool {
        self.gpu == *gpu && self.problem == *problem
    }
}

/// The on-disk document.
#[derive(Debug, Default, Serialize, Deserialize)]
struct TuneFile {
    format: String,
    version: u32,
    /// Decode launches.
    entries: Vec<TuneEntry>,
    /// Page-quantizer forms.
    #[serde(default)]
    forms: Vec<FormsEntry>,
}

/// Tuning results in memory, backed by a JSON file.
#[derive(Clone, Debug)]
pub struct TuneStore {
    path: PathBuf,
    entries: Vec<TuneEntry>,
    forms: Vec<FormsEntry>,
    warning: Option<String>,
}

/// The seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Parses a file's text; `Err` says why it is not usable.
fn parse(text: &str) -> std::result::Result<TuneFile, String> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not valid JSON ({e})"))?;
    let format = value.get("format").and_then(|f| f.as_str());
    if format != Some(FORMAT) {
        return Err(format!("not a kvq tuning file (format {format:?})"));
    }
    let version = value.get("version").and_then(|v| v.as_u64());
    if version != Some(VERSION as u64) {
        return Err(format!(
            "tuning file version {version:?}, this kvq reads version {VERSION}"
        ));
    }
    serde_json::from_value(value).map_err(|e| format!("malformed entries ({e})"))
}

/// The largest tuning file read. An entry is under a kilobyte of JSON, so 64 MiB holds tens of
/// thousands of tuned problems — more than any machine accumulates — while a file past it (or a
/// stray multi-gigabyte file at the path) is refused before it is read into memory.
pub const MAX_TUNE_FILE_BYTES: u64 = 64 << 20;

/// Reads `path`: `Ok(file)` (empty when absent) or `Err(warning)` when it cannot be used.
///
/// The read goes through [`read_input_file`], so a FIFO, device node or directory at the path, or
/// a file past [`MAX_TUNE_FILE_BYTES`], is reported like a damaged file instead of blocking on
/// the open or reading without end.
fn read(path: &Path) -> std::result::Result<TuneFile, String> {
    match read_input_file(path, "the tuning file", MAX_TUNE_FILE_BYTES) {
        Ok(bytes) => match String::from_utf8(bytes) {
            Ok(text) => parse(&text),
            Err(e) => Err(format!("not valid UTF-8 ({e})")),
        },
        Err(e) if e.not_found => Ok(TuneFile::default()),
        Err(e) => Err(e.why),
    }
}

fn warn(message: &str) {
    eprintln!("kvq: warning: {message}");
}

impl TuneStore {
    /// `<cache root>/tune.json` (`KVQ_CACHE_DIR`, else the user cache folder + `kvq`).
    pub fn default_path() -> Result<PathBuf> {
        Ok(cache_root()?.join(TUNE_FILE))
    }

    /// Loads `path`. Never fails: an unusable file gives an empty store, and a warning that is
    /// printed to stderr and kept ([`TuneStore::warning`]).
    pub fn open(path: impl Into<PathBuf>) -> TuneStore {
        let store = Self::load_quietly(path);
        if let Some(w) = &store.warning {
            warn(w);
        }
        store
    }

    /// As [`TuneStore::open`], without printing the warning.
    pub fn load_quietly(path: impl Into<PathBuf>) -> TuneStore {
        let path = path.into();
        let (file, warning) = match read(&path) {
            Ok(file) => (file, None),
            Err(why) => (
                TuneFile::default(),
                Some(format!(
                    "ignoring tuning results in {}: {why}; it will be replaced when a new result is saved",
                    path.display()
                )),
            ),
        };
        TuneStore {
            path,
            entries: file.entries,
            forms: file.forms,
            warning,
        }
    }

    /// A store that is not backed by a file until [`TuneStore::save`] is called.
    pub fn empty(path: impl Into<PathBuf>) -> TuneStore {
        TuneStore {
            path: path.into(),
            entries: Vec::new(),
            forms: Vec::new(),
            warning: None,
        }
    }

    /// The backing file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Why the file was ignored at load, if it was.
    pub fn warning(&self) -> Option<&str> {
        self.warning.as_deref()
    }

    /// Every decode entry, in file order.
    pub fn entries(&self) -> &[TuneEntry] {
        &self.entries
    }

    /// Every quantizer-forms entry, in file order.
    pub fn forms_entries(&self) -> &[FormsEntry] {
        &self.forms
    }

    /// The decode entry for `gpu` and `problem` whose configuration still validates (entries
    /// written by another kvq version may name parameters this one no longer declares).
    pub fn lookup(&self, gpu: &GpuKey, problem: &ProblemKey) -> Option<&TuneEntry> {
        lookup_in(&self.entries, gpu, problem, &self.path)
    }

    /// The quantizer-forms entry for `gpu` and `key`.
    pub fn lookup_forms(&self, gpu: &GpuKey, key: &FormsKey) -> Option<&FormsEntry> {
        lookup_in(&self.forms, gpu, key, &self.path)
    }

    /// Adds `entry`, replacing any entry with the same GPU and problem.
    pub fn insert(&mut self, entry: TuneEntry) {
        insert_in(&mut self.entries, entry);
    }

    /// Adds a quantizer-forms `entry`, replacing any with the same GPU and key.
    pub fn insert_forms(&mut self, entry: FormsEntry) {
        insert_in(&mut self.forms, entry);
    }

    /// Writes the store: re-reads the file, keeps its entries for keys this store lacks, adds all
    /// of this store's entries, and replaces the file atomically.
    pub fn save(&mut self) -> Result<()> {
        let old = read(&self.path).unwrap_or_default();
        let file = TuneFile {
            format: FORMAT.into(),
            version: VERSION,
            entries: merged(old.entries, &self.entries),
            forms: merged(old.forms, &self.forms),
        };
        let json = serde_json::to_string_pretty(&file).map_err(|e| RuntimeError::CacheIo {
            action: "encode tuning results for",
            path: self.path.clone(),
            source: std::io::Error::other(e),
        })?;
        write_atomically(&self.path, json.as_bytes())?;
        self.entries = file.entries;
        self.forms = file.forms;
        self.warning = None;
        Ok(())
    }
}

/// Writes `bytes` to a unique temporary file beside `path`, then renames it over `path`, so a
/// reader sees the old file or the new one, never a part.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir {
        fs::create_dir_all(dir).map_err(|source| RuntimeError::CacheIo {
            action: "create directory",
            path: dir.to_path_buf(),
            source,
        })?;
    }
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let name = path
        .file_name()
        .map_or_else(|| TUNE_FILE.into(), |n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(".{name}.{}.{nanos}.tmp", std::process::id()));
    let result = fs::write(&tmp, bytes)
        .map_err(|source| RuntimeError::CacheIo {
            action: "write",
            path: tmp.clone(),
            source,
        })
        .and_then(|()| {
            fs::rename(&tmp, path).map_err(|source| RuntimeError::CacheIo {
                action: "replace",
                path: path.to_path_buf(),
                source,
            })
        });
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::device::DriverVersion;
    use kvq_codegen::{Dtype, TuneParams};

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "kvq-tune-store-{tag}-{}-{}",
            std::process::id(),
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos())
        ));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    fn gpu(sms: u32) -> GpuKey {
        GpuKey {
            name: "NVIDIA H100 80GB HBM3".into(),
            compute_capability: (9, 0),
            sm_count: sms,
            driver: DriverVersion {
                major: 13,
                minor: 0,
            },
        }
    }

    fn problem(batch_bucket: usize) -> ProblemKey {
        ProblemKey {
            scheme_hash: "0123456789abcdef".into(),
            head_dim: 128,
            gqa: 4,
            dtype: Dtype::F16,
            kv_heads: 8,
            batch_bucket,
            context_bucket: 32_768,
            candidates: "00000000000000aa".into(),
        }
    }

    fn entry(gpu: GpuKey, problem: ProblemKey, splits: usize) -> TuneEntry {
        TuneEntry {
            gpu,
            problem,
            scheme: "k = int(2, channel), v = int(2, token)".into(),
            choice: TuneChoice {
                params: TuneParams {
                    threads: 256,
                    tile_tokens: 64,
                    min_warps_per_sm: 0,
                    pack_heads: false,
                    short_staging: true,
                    store_scores: true,
                },
                splits,
                pieces: crate::decode::Pieces::NONE,
            },
            tuned_us: 90.5,
            default_us: 100.25,
            measured_batch: 16,
            measured_len: 32_768,
            candidates: 45,
            rejected: 0,
            tuned_at_unix: 1_700_000_000,
            kvq_version: "0.1.0".into(),
            codebook: None,
            xquant: None,
        }
    }

    /// The choice read back from a file whose one entry lost `field` (which held `stored`), as a
    /// file written before that field existed has it.
    fn read_without(name: &str, field: &str, stored: bool) -> TuneChoice {
        let dir = temp_dir(name);
        let path = dir.join(TUNE_FILE);
        let mut store = TuneStore::open(&path);
        store.insert(entry(gpu(132), problem(16), 3));
        store.save().unwrap();
        let mut json: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        let choice = json["entries"][0]["choice"].as_object_mut().unwrap();
        assert_eq!(choice.remove(field), Some(serde_json::json!(stored)));
        fs::write(&path, serde_json::to_string(&json).unwrap()).unwrap();
        let back = TuneStore::open(&path);
        assert!(back.warning().is_none(), "{:?}", back.warning());
        let hit = back.lookup(&gpu(132), &problem(16)).unwrap();
        let _ = fs::remove_dir_all(&dir);
        hit.choice
    }

    #[test]
    fn results_stored_before_short_staging_was_a_choice_read_as_general_staging() {
        assert!(
            !read_without("prestaging", "short_staging", true)
                .params
                .short_staging
        );
    }

    #[test]
    fn results_stored_before_storing_scores_was_a_choice_read_as_keys_scored_twice() {
        assert!(
            !read_without("prestore", "store_scores", true)
                .params
                .store_scores
        );
    }

    #[test]
    fn results_stored_before_packing_was_a_choice_read_as_packing() {
        assert!(
            read_without("prepack", "pack_heads", false)
                .params
                .pack_heads
        );
    }

    #[test]
    fn round_trip_through_the_file() {
        let dir = temp_dir("roundtrip");
        let path = dir.join("nested").join(TUNE_FILE);
        let mut store = TuneStore::open(&path);
        assert!(store.entries().is_empty() && store.warning().is_none());
        store.insert(entry(gpu(132), problem(16), 3));
        store.insert(entry(gpu(132), problem(1), 33));
        store.save().unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"format\": \"kvq-tune\""), "{text}");
        assert!(text.contains("\"threads\": 256"), "{text}");
        let back = TuneStore::open(&path);
        assert!(back.warning().is_none());
        assert_eq!(back.entries(), store.entries());
        let hit = back.lookup(&gpu(132), &problem(16)).unwrap();
        assert_eq!(hit.choice.splits, 3);
        assert!(back.lookup(&gpu(114), &problem(16)).is_none());
        assert!(back.lookup(&gpu(132), &problem(4)).is_none());
        // No temporary files left behind.
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(TUNE_FILE)]);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn insert_replaces_and_save_merges_with_other_writers() {
        let dir = temp_dir("merge");
        let path = dir.join(TUNE_FILE);
        let mut a = TuneStore::open(&path);
        let mut b = TuneStore::open(&path);
        a.insert(entry(gpu(132), problem(16), 3));
        a.insert(entry(gpu(132), problem(16), 4));
        assert_eq!(a.entries().len(), 1);
        a.save().unwrap();
        b.insert(entry(gpu(132), problem(1), 33));
        b.save().unwrap();
        let both = TuneStore::open(&path);
        assert_eq!(both.entries().len(), 2);
        assert_eq!(
            both.lookup(&gpu(132), &problem(16)).unwrap().choice.splits,
            4
        );
        assert_eq!(
            both.lookup(&gpu(132), &problem(1)).unwrap().choice.splits,
            33
        );
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn damaged_or_foreign_files_are_ignored_and_replaced() {
        let dir = temp_dir("corrupt");
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join(TUNE_FILE);
        for (text, why) in [
            (
                "{\"format\": \"kvq-tune\", \"version\": 3, \"entries\": [",
                "not valid JSON",
            ),
            ("[1, 2, 3]", "not a kvq tuning file"),
            ("{\"format\": \"other\"}", "not a kvq tuning file"),
            (
                "{\"format\": \"kvq-tune\", \"version\": 99, \"entries\": []}",
                "version",
            ),
            (
                "{\"format\": \"kvq-tune\", \"version\": 1, \"entries\": []}",
                "version",
            ),
            (
                "{\"format\": \"kvq-tune\", \"version\": 2, \"entries\": []}",
                "version",
            ),
            (
                "{\"format\": \"kvq-tune\", \"version\": 3, \"entries\": [{\"gpu\": 1}]}",
                "malformed entries",
            ),
            ("\u{0}\u{1}binary", "not valid JSON"),
        ] {
            fs::write(&path, text).unwrap();
            let mut store = TuneStore::load_quietly(&path);
            assert!(store.entries().is_empty());
            let warning = store.warning().unwrap_or_default().to_string();
            assert!(warning.contains(why), "{text}: {warning}");
            assert!(warning.contains(&path.display().to_string()));
            store.insert(entry(gpu(132), problem(16), 3));
            store.save().unwrap();
            let back = TuneStore::load_quietly(&path);
            assert!(back.warning().is_none());
            assert_eq!(back.entries().len(), 1);
        }
        let _ = fs::remove_dir_all(&dir);
    }

    /// `f()` on another thread, failing the test when it takes more than 10 s (a read that blocks
    /// on a FIFO would otherwise hang the test run).
    pub(crate) fn promptly<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .expect("the load did not return within 10 s")
    }

    /// A FIFO at `path` (nothing ever writes to it, so opening it to read blocks forever).
    #[cfg(unix)]
    pub(crate) fn make_fifo(path: &Path) {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
        let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
        assert_eq!(rc, 0, "mkfifo {}", path.display());
    }

    #[cfg(unix)]
    #[test]
    fn a_fifo_device_or_oversized_store_is_a_warning_promptly_never_a_hang() {
        let dir = temp_dir("special");
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join(TUNE_FILE);

        make_fifo(&path);
        let p = path.clone();
        let store = promptly(move || TuneStore::load_quietly(p));
        assert!(store.entries().is_empty());
        let warning = store.warning().unwrap_or_default().to_string();
        assert!(
            warning.contains("a FIFO") && warning.contains(&path.display().to_string()),
            "{warning}"
        );
        // A save reads the file to merge, then replaces the FIFO with a real file.
        let mut store = store;
        store.insert(entry(gpu(132), problem(16), 3));
        promptly(move || store.save()).unwrap();
        let back = TuneStore::load_quietly(&path);
        assert!(back.warning().is_none() && back.entries().len() == 1);

        fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        let p = path.clone();
        let store = promptly(move || TuneStore::load_quietly(p));
        let warning = store.warning().unwrap_or_default().to_string();
        assert!(warning.contains("a character device"), "{warning}");

        // Sparse, so the test writes nothing: only its stated size is past the limit.
        fs::remove_file(&path).unwrap();
        fs::File::create(&path)
            .unwrap()
            .set_len(MAX_TUNE_FILE_BYTES + 1)
            .unwrap();
        let p = path.clone();
        let store = promptly(move || TuneStore::load_quietly(p));
        let warning = store.warning().unwrap_or_default().to_string();
        assert!(
            warning.contains(&format!("{} bytes", MAX_TUNE_FILE_BYTES + 1)),
            "{warning}"
        );
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn entries_that_no_longer_validate_are_skipped() {
        let dir = temp_dir("invalid");
        let path = dir.join(TUNE_FILE);
        let mut store = TuneStore::empty(&path);
        let mut bad = entry(gpu(132), problem(16), 3);
        bad.choice.params.threads = 96;
        store.insert(bad);
        store.insert(entry(gpu(132), problem(2), 0));
        store.save().unwrap();
        let back = TuneStore::load_quietly(&path);
        assert_eq!(back.entries().len(), 2);
        assert!(back.lookup(&gpu(132), &problem(16)).is_none());
        assert!(back.lookup(&gpu(132), &problem(2)).is_none());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn xquant_launches_round_trip_and_are_checked_by_their_own_bounds() {
        let dir = temp_dir("xquant");
        let path = dir.join(TUNE_FILE);
        let mut store = TuneStore::empty(&path);
        let xq = |splits: usize, rank: usize| {
            let mut e = entry(gpu(132), problem(1), splits);
            // The decode's own block: 512 threads would fail the integer templates' check.
            e.choice.params.threads = 512;
            e.choice.params.tile_tokens = 128;
            e.problem.candidates = format!("xq-{splits:04}-{rank}");
            e.xquant = Some(crate::xquant::XQuantTuned {
                rank,
                rebuild: "F16 Warpgroup".into(),
            });
            e
        };
        store.insert(xq(16, 1024));
        store.insert(xq(0, 1024));
        store.insert(xq(1025, 1024));
        store.insert(xq(8, 0));
        store.save().unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"rebuild\": \"F16 Warpgroup\""), "{text}");
        let back = TuneStore::load_quietly(&path);
        assert_eq!(back.entries(), store.entries());
        let hit = back.lookup(&gpu(132), &xq(16, 1024).problem).unwrap();
        assert_eq!(hit.choice.splits, 16);
        assert_eq!(hit.xquant.as_ref().unwrap().rank, 1024);
        for bad in [xq(0, 1024), xq(1025, 1024), xq(8, 0)] {
            assert!(back.lookup(&gpu(132), &bad.problem).is_none(), "{bad:?}");
        }
        // Integer entries write no `xquant` field, so older readers see the same file.
        let plain_path = dir.join("plain.json");
        let mut plain = TuneStore::empty(&plain_path);
        plain.insert(entry(gpu(132), problem(2), 3));
        plain.save().unwrap();
        assert!(!fs::read_to_string(&plain_path).unwrap().contains("xquant"));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_unwritable_location_is_a_typed_error() {
        let dir = temp_dir("unwritable");
        fs::create_dir_all(&dir).unwrap();
        // A file where the folder should be.
        let blocker = dir.join("blocker");
        fs::write(&blocker, "x").unwrap();
        let mut store = TuneStore::empty(blocker.join(TUNE_FILE));
        store.insert(entry(gpu(132), problem(16), 3));
        assert!(matches!(store.save(), Err(RuntimeError::CacheIo { .. })));
        let _ = fs::remove_dir_all(&dir);
    }
}
