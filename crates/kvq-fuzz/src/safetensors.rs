//! The safetensors target: file bytes → `kvq eval`'s reader (`kvq_cli::eval::read_layers`, in
//! both layouts) → for a file it accepts, the whole `kvq eval --cpu` run (`kvq_cli::eval::run`)
//! with a built-in scheme chosen by the file's hash.
//!
//! Besides "no panic, no hang, no abort" it checks that a refusal reads as a sentence: a message
//! that carries a raw safetensors error name (`HeaderTooSmall`, `InvalidOffset("layer.0.v")`) is
//! a finding.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use kvq_cli::eval::{self, EvalOptions, KvLayout};
use kvq_cli::scheme::resolve;

/// Built-ins a file the reader accepts is evaluated with.
pub const SCHEMES: [&str; 7] = [
    "kivi2",
    "kitty",
    "fp16",
    "int8",
    "calibquant1",
    "kitty-pro",
    "xquant2",
];

/// Names of the safetensors crate's error variants, as its `Display` (which is `Debug`) prints them.
const RAW_NAMES: [&str; 14] = [
    "InvalidHeader",
    "InvalidHeaderStart",
    "InvalidHeaderDeserialization",
    "HeaderTooLarge",
    "HeaderTooSmall",
    "InvalidHeaderLength",
    "TensorNotFound(",
    "TensorInvalidInfo",
    "InvalidOffset(",
    "IoError(",
    "JsonError(",
    "InvalidTensorView(",
    "MetadataIncompleteBuffer",
    "ValidationOverflow",
];

/// A file path private to this process and thread, so parallel runs do not share one.
fn scratch_path() -> PathBuf {
    let thread = format!("{:?}", std::thread::current().id())
        .chars()
        .filter(char::is_ascii_digit)
        .collect::<String>();
    std::env::temp_dir().join(format!(
        "kvq-fuzz-{}-{thread}.safetensors",
        std::process::id()
    ))
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn readable(message: &str) -> Result<(), String> {
    match RAW_NAMES.iter().find(|n| message.contains(*n)) {
        Some(name) => Err(format!(
            "raw safetensors error name in a message: `{name}` in \"{message}\""
        )),
        None => Ok(()),
    }
}

/// Files of this process the reader accepted in at least one layout.
pub static READ: AtomicU64 = AtomicU64::new(0);

/// The target's check; see the module docs.
pub fn check(input: &[u8]) -> Result<(), String> {
    let path = scratch_path();
    std::fs::write(&path, input).map_err(|e| format!("harness: cannot write {path:?}: {e}"))?;
    let result = check_file(&path, fnv(input));
    let _ = std::fs::remove_file(&path);
    result
}

/// Reads and evaluates one file; see the module docs.
pub fn check_file(path: &std::path::Path, salt: u64) -> Result<(), String> {
    let mut read = false;
    for layout in [KvLayout::TokensFirst, KvLayout::HeadsFirst] {
        let layers = match eval::read_layers(path, layout, &[]) {
            Ok(layers) => layers,
            Err(e) => {
                readable(&e.to_string())?;
                continue;
            }
        };
        if !read {
            read = true;
            READ.fetch_add(1, Ordering::Relaxed);
        }
        let _ = eval::read_layers(path, layout, &[0, usize::MAX]);
        if layers.is_empty() {
            continue;
        }
        let name = SCHEMES[(salt % SCHEMES.len() as u64) as usize];
        let scheme = resolve(name).map_err(|e| format!("harness: built-in `{name}`: {e}"))?;
        let opts = EvalOptions {
            scheme,
            file: path.to_path_buf(),
            layout,
            layers: Vec::new(),
            cpu_only: true,
            device: 0,
            // Every other input through the JSON output too.
            json: salt % 2 == 1,
            // Every third with a RoPE base (what CommVQ and XQuant schemes need).
            rope_theta: (salt % 3 == 0).then_some(10_000.0),
            // Every fifth at the last query only.
            last_query: salt % 5 == 0,
        };
        if let Err(e) = eval::run(&opts) {
            readable(&e.to_string())?;
        }
    }
    Ok(())
}
