//! `kvq info`: what this machine offers kvq — GPU, driver, NVRTC, cache folders, tuned entries.
//! Every missing piece is one line saying what is missing and why; nothing here fails.

use std::path::Path;

use kvq::runtime::decode::{is_fast_memory, FAST_MEMORY_GBPS_PER_SM};
use kvq::runtime::tune::{GpuKey, TunePolicy, TuneStore, KVQ_TUNE, TUNE_FILE};
use kvq::runtime::{cache_root, device_count, driver_version, nvrtc, Device};

/// Files and bytes directly inside `dir` whose name ends with one of `exts`.
fn count_files(dir: &Path, exts: &[&str]) -> Option<(usize, u64)> {
    let entries = std::fs::read_dir(dir).ok()?;
    let mut n = 0;
    let mut bytes = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if exts.iter().any(|x| name.ends_with(x)) {
            n += 1;
            bytes += e.metadata().map_or(0, |m| m.len());
        }
    }
    Some((n, bytes))
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// The GPU's peak DRAM bandwidth an SM, and what the untuned launches make of it.
fn memory_line(peak_gbps: f64, sm_count: usize) -> String {
    let per_sm = peak_gbps / sm_count.max(1) as f64;
    let verdict = if is_fast_memory(peak_gbps, sm_count) {
        "fast: KIVI-4's kernels take twelve warps an SM untuned"
    } else {
        "KIVI-4's kernels keep eight warps an SM untuned"
    };
    format!(
        "memory:       {per_sm:.1} GB/s peak an SM ({verdict}; from {FAST_MEMORY_GBPS_PER_SM:.0} GB/s on)"
    )
}

/// The `KVQ_TUNE` line, read by the runtime's own parser: an unknown value is shown as the error
/// the runtime will return for it, naming the accepted values.
fn tune_line(value: Option<&str>) -> String {
    let shown = match TunePolicy::from_env_value(value) {
        Ok(policy) if value.map_or(true, |v| v.trim().is_empty()) => {
            format!("unset ({policy}: stored results, else the heuristic)")
        }
        Ok(policy) => policy.to_string(),
        Err(e) => format!("{e}; the tuner refuses to start until it is fixed"),
    };
    format!("KVQ_TUNE:     {shown}")
}

/// The report, one `key: value` line each.
pub fn report(ordinal: usize) -> String {
    let mut lines: Vec<String> = vec![format!("kvq {}", env!("CARGO_PKG_VERSION"))];
    let mut gpu_key = None;
    let driver = driver_version();
    match &driver {
        Ok(v) => lines.push(format!("driver:       {v}")),
        Err(e) => lines.push(format!("driver:       not available: {e}")),
    }
    match device_count() {
        // Said once, on the driver line.
        Err(_) if driver.is_err() => {
            lines.push("GPUs:         none usable (the driver line says why)".into())
        }
        Ok(0) => lines.push("GPUs:         none (the driver reports 0 devices)".into()),
        Ok(n) => {
            lines.push(format!("GPUs:         {n}"));
            match Device::open(ordinal) {
                Ok(d) => {
                    let p = d.props();
                    lines.push(format!(
                        "GPU {}:        {} (compute {}.{}, kernels for {}, {} SMs, {:.1} GiB memory, {} MiB L2, \
                         {:.0} GB/s peak DRAM)",
                        p.ordinal,
                        p.name,
                        p.compute_capability.0,
                        p.compute_capability.1,
                        p.arch,
                        p.sm_count,
                        p.total_memory_bytes as f64 / (1u64 << 30) as f64,
                        p.l2_bytes >> 20,
                        p.peak_memory_bandwidth_gbps()
                    ));
                    lines.push(memory_line(
                        p.peak_memory_bandwidth_gbps(),
                        p.sm_count as usize,
                    ));
                    gpu_key = Some(GpuKey::of(p));
                }
                Err(e) => lines.push(format!("GPU {ordinal}:        not usable: {e}")),
            }
        }
        Err(e) => lines.push(format!("GPUs:         unknown: {e}")),
    }
    match nvrtc::version() {
        Ok(v) => {
            let archs = nvrtc::supported_archs()
                .map(|a| {
                    let first = a.first().map_or(String::new(), |x| format!("sm_{x}"));
                    let last = a.last().map_or(String::new(), |x| format!("sm_{x}"));
                    format!(" (targets {first} … {last})")
                })
                .unwrap_or_default();
            lines.push(format!("NVRTC:        {v}{archs}"));
        }
        Err(e) => lines.push(format!("NVRTC:        not available: {e}")),
    }
    match cache_root() {
        Ok(root) => {
            let from = match std::env::var_os("KVQ_CACHE_DIR") {
                Some(v) if !v.is_empty() => "KVQ_CACHE_DIR",
                _ => "user cache folder; set KVQ_CACHE_DIR to move it",
            };
            lines.push(format!("cache dir:    {} ({from})", root.display()));
            let modules = root.join("modules");
            match count_files(&modules, &[".cubin", ".ptx"]) {
                Some((n, bytes)) => lines.push(format!(
                    "module cache: {} ({n} compiled modules, {})",
                    modules.display(),
                    mib(bytes)
                )),
                None => lines.push(format!(
                    "module cache: {} (not created yet)",
                    modules.display()
                )),
            }
            let tune = root.join(TUNE_FILE);
            if tune.exists() {
                let store = TuneStore::load_quietly(&tune);
                match store.warning() {
                    Some(w) => {
                        lines.push(format!("tune file:    {} (unusable: {w})", tune.display()))
                    }
                    None => {
                        let here = gpu_key.as_ref().map(|g| {
                            let n = store.entries().iter().filter(|e| &e.gpu == g).count();
                            format!(", {n} for this GPU")
                        });
                        lines.push(format!(
                            "tune file:    {} ({} tuned entries{})",
                            tune.display(),
                            store.entries().len(),
                            here.unwrap_or_default()
                        ));
                    }
                }
            } else {
                lines.push(format!(
                    "tune file:    {} (absent: 0 tuned entries; `kvq tune` writes it)",
                    tune.display()
                ));
            }
        }
        Err(e) => lines.push(format!("cache dir:    not available: {e}")),
    }
    lines.push(tune_line(std::env::var(KVQ_TUNE).ok().as_deref()));
    let mut s = lines.join("\n");
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::{memory_line, tune_line};

    #[test]
    fn an_unknown_kvq_tune_is_shown_as_an_error_naming_the_accepted_values() {
        let line = tune_line(Some("bogus"));
        assert!(
            line.starts_with("KVQ_TUNE:     invalid input: KVQ_TUNE=`bogus`"),
            "{line}"
        );
        assert!(
            line.contains("off, cached or full") && line.contains("tuner refuses"),
            "{line}"
        );
        assert_eq!(tune_line(Some(" FULL ")), "KVQ_TUNE:     full");
        assert!(
            tune_line(None).contains("unset (cached"),
            "{}",
            tune_line(None)
        );
        assert!(tune_line(Some("")).contains("unset (cached"));
    }

    #[test]
    fn the_memory_line_says_which_occupancy_kivi4_takes() {
        let h100 = memory_line(3352.0, 132);
        assert!(
            h100.starts_with("memory:       25.4 GB/s peak an SM"),
            "{h100}"
        );
        assert!(h100.contains("keep eight warps"), "{h100}");
        let h200 = memory_line(4814.0, 132);
        assert!(
            h200.starts_with("memory:       36.5 GB/s peak an SM (fast"),
            "{h200}"
        );
        assert!(h200.contains("twelve warps"), "{h200}");
    }
}
