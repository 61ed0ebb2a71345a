//! The results of a run and their markdown and JSON forms.

use kvq::reference::resources::read_input_file;
use kvq::runtime::tune::TuneChoice;
use kvq::runtime::DeviceProps;
use serde::{Deserialize, Serialize};

use crate::copy::CopyResult;
use crate::grid::format_tokens;

/// The largest results file read. A full run's grid is a few hundred rows, well under a megabyte
/// of JSON; 64 MiB leaves room for far larger grids while a stray huge file is refused before it
/// is read into memory.
pub const MAX_RESULTS_FILE_BYTES: u64 = 64 << 20;

/// A tuned configuration measured beside the default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TunedResult {
    /// The tuner's choice.
    pub choice: TuneChoice,
    /// Its median in this run, µs (same rounds as the default's).
    pub median_us: f64,
    /// Default median over tuned median.
    pub gain: f64,
    /// Wall-clock seconds the tuning session took.
    pub tune_seconds: f64,
    /// Configurations the tuner timed.
    pub candidates: usize,
    /// Configurations its correctness check (or build) discarded.
    pub rejected: usize,
}

impl TunedResult {
    /// Whether the tuner chose `row`'s untuned launch itself.
    pub fn kept_default(&self, row: &Row) -> bool {
        self.choice == row.choice
    }
}

/// What the markdown table's tuned config column says where [`TunedResult::kept_default`].
const KEPT_DEFAULT: &str = "the default";

/// One (scheme, batch, context) measurement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Scheme name.
    pub scheme: String,
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub context: usize,
    /// The default configuration timed.
    pub choice: TuneChoice,
    /// The score-range grid's split count where the scheme calibrates
    /// (`DecodeKernel::range_splits`); `None` otherwise, and in results written before it.
    #[serde(default)]
    pub range_splits: Option<usize>,
    /// Median, µs.
    pub median_us: f64,
    /// Fastest run, µs.
    pub min_us: f64,
    /// Bytes the step must move (see `bytes`).
    pub bytes: u64,
    /// Bytes the scheme's definition makes the step move on top of `bytes` (CalibQuant's range
    /// pass re-reading K, or the scores it stores for the decode kernel; see
    /// `bytes::extra_bytes`), not counted in `bytes`.
    #[serde(default, alias = "reread_bytes")]
    pub extra_bytes: u64,
    /// The extra bytes are stored scores (written and read back) rather than K read again.
    #[serde(default)]
    pub stored_scores: bool,
    /// `bytes / median`, GB/s.
    pub gbps: f64,
    /// `gbps` over the copy bandwidth of this run, %.
    pub pct_of_copy: f64,
    /// kvq FP16's median at this shape over this row's median.
    pub speedup_vs_fp16: Option<f64>,
    /// Largest relative error of the checked rows (`None`: not checked).
    pub max_rel_error: Option<f64>,
    /// Copies rotated through while timing.
    pub copies: usize,
    /// Median µs of one launch of a plain read of `bytes` in the same run, rotating as many
    /// copies (`read_floor`); `None` where it was not measured (results written before it, or
    /// no memory for it).
    #[serde(default)]
    pub read_floor_us: Option<f64>,
    /// With `--tune`.
    pub tuned: Option<TunedResult>,
    /// Why the generic CUDA-core kernel ran instead of the tensor-core one, where it did
    /// (`kvq_codegen::SlowPath`); the table marks such rows.
    #[serde(default)]
    pub slow_path: Option<String>,
    /// XQuant: how K was rebuilt (precision and MMA form, e.g. `F16 Warpgroup`); `None` for the
    /// other schemes, and in results written before XQuant was benchmarked.
    #[serde(default)]
    pub rebuild: Option<String>,
    /// XQuant: the K rebuild's useful tensor-core work, FLOP (`2·R·D` a token and KV head). Its
    /// floor is compute, not bytes: the note under the table gives the rate it ran at.
    #[serde(default)]
    pub rebuild_flop: Option<f64>,
}

impl Row {
    /// The scheme cell of the table: the name, marked where the slow generic kernel ran.
    pub fn scheme_text(&self) -> String {
        match (&self.slow_path, &self.rebuild) {
            (Some(why), _) => format!("{} (generic kernel: {why})", self.scheme),
            (None, Some(rebuild)) => format!("{} ({rebuild} rebuild)", self.scheme),
            (None, None) => self.scheme.clone(),
        }
    }

    /// The K rebuild's useful tensor-core rate at this row's median, TFLOP/s (XQuant rows).
    pub fn rebuild_tflops(&self) -> Option<f64> {
        self.rebuild_flop
            .map(|f| f / (self.median_us * 1e-6) / 1e12)
    }

    /// The most "% of copy" this step can show when every byte it reads moves at the copy
    /// bandwidth: 100 unless it reads bytes twice.
    pub fn ceiling_pct_of_copy(&self) -> f64 {
        100.0 * self.bytes as f64 / (self.bytes + self.extra_bytes) as f64
    }

    /// The step's median over the read floor's: how many times one launch's least time to read
    /// the same bytes the step takes (1.5 is the "within 1.5× of the floor" at B=1).
    pub fn times_read_floor(&self) -> Option<f64> {
        self.read_floor_us.map(|floor| self.median_us / floor)
    }

    /// The default launch as the table shows it: the configuration, and the range grid's splits
    /// where there is one.
    pub fn launch_text(&self) -> String {
        match self.range_splits {
            Some(n) => format!("{} range splits {n}", self.choice),
            None => self.choice.to_string(),
        }
    }
}

/// A shape that was not measured, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Skipped {
    /// Scheme name.
    pub scheme: String,
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub context: usize,
    /// Why.
    pub reason: String,
}

/// Everything a run produced.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchResults {
    /// The GPU.
    pub gpu: DeviceProps,
    /// `YYYY-MM-DD`, UTC.
    pub date: String,
    /// Seconds since the Unix epoch.
    pub unix_time: u64,
    /// Free text from `--label` (e.g. the commit).
    pub label: Option<String>,
    /// Query heads, KV heads, head_dim, dtype.
    pub shape: String,
    /// The bandwidth ceiling of this run.
    pub copy: CopyResult,
    /// Measured shapes, in run order.
    pub rows: Vec<Row>,
    /// Shapes not measured.
    pub skipped: Vec<Skipped>,
}

fn opt(x: Option<f64>, digits: usize) -> String {
    x.map_or_else(|| "–".into(), |v| format!("{v:.digits$}"))
}

impl BenchResults {
    /// Fills every row's speedup over the `fp16` row of the same batch and context.
    pub fn fill_speedups(&mut self) {
        let fp16: Vec<(usize, usize, f64)> = self
            .rows
            .iter()
            .filter(|r| r.scheme == "fp16")
            .map(|r| (r.batch, r.context, r.median_us))
            .collect();
        for r in &mut self.rows {
            r.speedup_vs_fp16 = fp16
                .iter()
                .find(|(b, l, _)| *b == r.batch && *l == r.context)
                .map(|(_, _, us)| us / r.median_us);
        }
    }

    /// The table as GitHub markdown, with a header naming the GPU, date and copy bandwidth.
    pub fn markdown(&self) -> String {
        let tuned = self.rows.iter().any(|r| r.tuned.is_some());
        let mut s = format!(
            "GPU: {} (compute {}.{}, {} SMs, {} MiB L2, {}), {} UTC{}\n\n\
             Shape: {}. Copy bandwidth (device-to-device, {:.1} GiB, read + write): **{:.0} GB/s**.\n\n",
            self.gpu.name,
            self.gpu.compute_capability.0,
            self.gpu.compute_capability.1,
            self.gpu.sm_count,
            self.gpu.l2_bytes >> 20,
            self.gpu.driver,
            self.date,
            self.label
                .as_ref()
                .map_or_else(String::new, |l| format!(", {l}")),
            self.shape,
            self.copy.bytes as f64 / (1u64 << 30) as f64,
            self.copy.gbps,
        );
        s.push_str(
            "| scheme | B | L | median µs | GB/s | % of copy | × FP16 | config | max rel err | read µs | × read |",
        );
        if tuned {
            s.push_str(" tuned µs | tuned gain | tuned config | tune s |");
        }
        s.push('\n');
        s.push_str("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|");
        if tuned {
            s.push_str("---:|---:|---|---:|");
        }
        s.push('\n');
        for r in &self.rows {
            s.push_str(&format!(
                "| {} | {} | {} | {:.1} | {:.0} | {:.1} | {} | {} | {} | {} | {} |",
                r.scheme_text(),
                r.batch,
                format_tokens(r.context),
                r.median_us,
                r.gbps,
                r.pct_of_copy,
                opt(r.speedup_vs_fp16, 2),
                r.launch_text(),
                r.max_rel_error
                    .map_or_else(|| "–".into(), |e| format!("{e:.1e}")),
                opt(r.read_floor_us, 1),
                opt(r.times_read_floor(), 2),
            ));
            if tuned {
                match &r.tuned {
                    Some(t) => s.push_str(&format!(
                        " {:.1} | {:.3} | {} | {:.1} |",
                        t.median_us,
                        t.gain,
                        if t.kept_default(r) {
                            KEPT_DEFAULT.to_string()
                        } else {
                            t.choice.to_string()
                        },
                        t.tune_seconds
                    )),
                    None => s.push_str(" – | – | – | – |"),
                }
            }
            s.push('\n');
        }
        if self
            .rows
            .iter()
            .any(|r| r.tuned.as_ref().is_some_and(|t| t.kept_default(r)))
        {
            s.push_str(&format!(
                "\ntuned config \"{KEPT_DEFAULT}\": the tuner kept the untuned launch, so its gain is \
                 the same kernel timed twice (the spread between timings).\n"
            ));
        }
        if self.rows.iter().any(|r| r.read_floor_us.is_some()) {
            s.push_str(
                "\nread µs: one launch of a plain streaming read of the row's bytes, timed like the \
                 step (same copies, same queueing); × read: the step's median over it.\n",
            );
        }
        let rebuilds: Vec<&Row> = self
            .rows
            .iter()
            .filter(|r| r.rebuild_flop.is_some())
            .collect();
        if !rebuilds.is_empty() {
            s.push_str(
                "\nXQuant rows: bytes, GB/s and read µs count what the step reads (the latents' \
                 store, XQuant-CL's f16 accumulator latents, the projections' up factors once, \
                 queries and outputs), but their floor is compute: rebuilding K from the latents \
                 on tensor cores, 2·R·D FLOP a token and KV head (counted once whatever the \
                 rebuild's passes). max rel err covers the last KV head's query heads of the \
                 first and last row (the CPU rebuilds one KV head; the rest is checked finite).\n",
            );
            for r in rebuilds {
                s.push_str(&format!(
                    "- {} B={} L={}: K rebuild {:.3} TFLOP, {:.1} TFLOP/s of useful tensor work at \
                     the median\n",
                    r.scheme,
                    r.batch,
                    format_tokens(r.context),
                    r.rebuild_flop.unwrap_or(0.0) / 1e12,
                    r.rebuild_tflops().unwrap_or(f64::NAN),
                ));
            }
        }
        let extras: Vec<&Row> = self.rows.iter().filter(|r| r.extra_bytes > 0).collect();
        if !extras.is_empty() {
            s.push_str("\nMoved on top (not counted as effective bytes):\n");
            for r in extras {
                let what = if r.stored_scores {
                    "scores the range pass writes and the decode kernel reads back (instead of K),"
                } else {
                    "K read again by the range pass,"
                };
                s.push_str(&format!(
                    "- {} B={} L={}: {what} {:.1} MB (+{:.0}%), so at the copy bandwidth the step \
                     would reach at most {:.1}% of copy\n",
                    r.scheme,
                    r.batch,
                    format_tokens(r.context),
                    r.extra_bytes as f64 / 1e6,
                    100.0 * r.extra_bytes as f64 / r.bytes as f64,
                    r.ceiling_pct_of_copy(),
                ));
            }
        }
        if !self.skipped.is_empty() {
            s.push_str("\nNot measured:\n");
            for k in &self.skipped {
                s.push_str(&format!(
                    "- {} B={} L={}: {}\n",
                    k.scheme,
                    k.batch,
                    format_tokens(k.context),
                    k.reason
                ));
            }
        }
        s
    }

    /// Reads results written by [`BenchResults::json`] (to redraw or re-tabulate them without a
    /// GPU).
    pub fn from_json(text: &str) -> Result<BenchResults, String> {
        serde_json::from_str(text).map_err(|e| e.to_string())
    }

    /// Reads the results file at `path` (see [`BenchResults::from_json`]); `Err` says why, without
    /// the path. The file goes through [`read_input_file`]: a FIFO, device node or directory is
    /// refused without being opened, and a file past [`MAX_RESULTS_FILE_BYTES`] without being read.
    pub fn read_json_file(path: &std::path::Path) -> Result<BenchResults, String> {
        let bytes =
            read_input_file(path, "the results file", MAX_RESULTS_FILE_BYTES).map_err(|e| e.why)?;
        serde_json::from_slice(&bytes).map_err(|e| e.to_string())
    }

    /// Pretty JSON of everything.
    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use kvq::codegen::TuneParams;
    use kvq::runtime::{Arch, DriverVersion};

    pub(crate) fn sample() -> BenchResults {
        let choice = TuneChoice {
            params: TuneParams {
                threads: 128,
                tile_tokens: 32,
                min_warps_per_sm: 0,
                pack_heads: true,
                short_staging: false,
                store_scores: false,
            },
            splits: 3,
            pieces: kvq::runtime::Pieces::NONE,
        };
        let row = |scheme: &str, batch, context, us: f64| Row {
            scheme: scheme.into(),
            batch,
            context,
            choice,
            range_splits: None,
            median_us: us,
            min_us: us * 0.98,
            bytes: 1 << 30,
            extra_bytes: 0,
            stored_scores: false,
            gbps: (1u64 << 30) as f64 / us / 1e3,
            pct_of_copy: 50.0,
            speedup_vs_fp16: None,
            max_rel_error: Some(3e-4),
            copies: 1,
            read_floor_us: None,
            tuned: None,
            slow_path: None,
            rebuild: None,
            rebuild_flop: None,
        };
        let mut rows = vec![
            row("fp16", 1, 4096, 20.0),
            row("kivi2", 1, 4096, 8.0),
            row("fp16", 16, 4096, 200.0),
            row("kivi2", 16, 4096, 40.0),
            row("kivi2", 1, 32_768, 30.0),
            row("calibquant1", 1, 32_768, 30.0),
        ];
        rows[5].extra_bytes = 1 << 29;
        rows[3].tuned = Some(TunedResult {
            choice: TuneChoice {
                splits: 4,
                ..choice
            },
            median_us: 36.0,
            gain: 40.0 / 36.0,
            tune_seconds: 4.2,
            candidates: 45,
            rejected: 0,
        });
        rows[1].tuned = Some(TunedResult {
            choice,
            median_us: 8.1,
            gain: 8.0 / 8.1,
            tune_seconds: 1.5,
            candidates: 45,
            rejected: 0,
        });
        BenchResults {
            gpu: DeviceProps {
                ordinal: 0,
                name: "NVIDIA H100 80GB HBM3".into(),
                compute_capability: (9, 0),
                arch: Arch::SM_90A,
                sm_count: 132,
                l2_bytes: 50 << 20,
                total_memory_bytes: 80 << 30,
                max_shared_memory_per_block_optin: 232_448,
                memory_bus_width_bits: 5120,
                memory_clock_khz: 2_619_000,
                driver: DriverVersion {
                    major: 13,
                    minor: 0,
                },
            },
            date: "2026-11-22".into(),
            unix_time: 0,
            label: Some("abc1234".into()),
            shape: "32 query heads, 8 KV heads, head_dim 128, f16".into(),
            copy: CopyResult {
                bytes: 4 << 30,
                median_us: 2900.0,
                gbps: 2962.0,
            },
            rows,
            skipped: vec![Skipped {
                scheme: "fp16".into(),
                batch: 16,
                context: 131_072,
                reason: "does not fit".into(),
            }],
        }
    }

    #[test]
    fn speedups_compare_with_fp16_at_the_same_shape_only() {
        let mut r = sample();
        r.fill_speedups();
        let get = |s: &str, b, l| {
            r.rows
                .iter()
                .find(|x| x.scheme == s && x.batch == b && x.context == l)
                .unwrap()
                .speedup_vs_fp16
        };
        assert_eq!(get("fp16", 1, 4096), Some(1.0));
        assert_eq!(get("kivi2", 1, 4096), Some(2.5));
        assert_eq!(get("kivi2", 16, 4096), Some(5.0));
        assert_eq!(get("kivi2", 1, 32_768), None);
    }

    #[test]
    fn markdown_and_json_carry_every_row() {
        let mut r = sample();
        r.fill_speedups();
        let md = r.markdown();
        assert!(md.contains("NVIDIA H100 80GB HBM3"));
        assert!(md.contains("2962 GB/s"));
        assert!(md.contains("| kivi2 | 16 | 4K | 40.0 |"), "{md}");
        assert!(md.contains("| 3.0e-4 | – | – |"), "{md}");
        assert!(!md.contains("one launch of a plain streaming read"));
        assert!(md.contains("tuned gain"));
        assert!(md.contains("1.111"));
        // Row 1's tuner kept the default: said so, and the footnote says what its gain means.
        assert!(md.contains("| 8.1 | 0.988 | the default | 1.5 |"), "{md}");
        assert!(!md.contains("| 36.0 | 1.111 | the default |"), "{md}");
        assert!(md.contains("the same kernel timed twice"), "{md}");
        assert!(md.contains("fp16 B=16 L=128K: does not fit"));
        assert_eq!(md.lines().filter(|l| l.starts_with("| kivi2")).count(), 3);
        let json: serde_json::Value = serde_json::from_str(&r.json()).unwrap();
        assert_eq!(json["rows"].as_array().unwrap().len(), 6);
        assert!(
            md.contains("- calibquant1 B=1 L=32K: K read again by the range pass, 536.9 MB (+50%), so at the copy bandwidth the step would reach at most 66.7% of copy"),
            "{md}"
        );
        assert_eq!(md.matches("read again by the range pass").count(), 1);
        assert_eq!(json["rows"][3]["tuned"]["choice"]["splits"], 4);
        assert_eq!(json["copy"]["gbps"], 2962.0);
        let back = BenchResults::from_json(&r.json()).unwrap();
        assert_eq!(back.rows, r.rows);
        assert_eq!(back.markdown(), md);
    }

    /// An XQuant row names its rebuild, and the note under the table gives its compute floor's
    /// work and the rate it ran at; results written before XQuant rows still read.
    #[test]
    fn xquant_rows_name_their_rebuild_and_its_rate() {
        let mut r = sample();
        r.rows[4].scheme = "xquant2".into();
        r.rows[4].rebuild = Some("F16 Warpgroup".into());
        // 1.2 TFLOP in 30 µs would be 40,000 TFLOP/s: the arithmetic, not a claim.
        r.rows[4].rebuild_flop = Some(1.2e12);
        let md = r.markdown();
        assert!(
            md.contains("| xquant2 (F16 Warpgroup rebuild) | 1 | 32K |"),
            "{md}"
        );
        assert!(md.contains("their floor is compute"), "{md}");
        assert!(
            md.contains("- xquant2 B=1 L=32K: K rebuild 1.200 TFLOP, 40000.0 TFLOP/s"),
            "{md}"
        );
        let back = BenchResults::from_json(&r.json()).unwrap();
        assert_eq!(back.rows, r.rows);
        let mut old: serde_json::Value = serde_json::from_str(&sample().json()).unwrap();
        for row in old["rows"].as_array_mut().unwrap() {
            let row = row.as_object_mut().unwrap();
            row.remove("rebuild");
            row.remove("rebuild_flop");
        }
        let old = old.to_string();
        assert!(!old.contains("rebuild"));
        assert!(BenchResults::from_json(&old).unwrap().rows[4]
            .rebuild
            .is_none());
        assert!(!sample().markdown().contains("floor is compute"));
    }

    /// A row the generic kernel ran says so in its scheme cell, and the reason survives JSON.
    #[test]
    fn slow_path_rows_are_marked() {
        let mut r = sample();
        r.rows[1].slow_path = Some("head_dim 288".into());
        let md = r.markdown();
        assert!(
            md.contains("| kivi2 (generic kernel: head_dim 288) | 1 | 4K |"),
            "{md}"
        );
        assert_eq!(md.matches("generic kernel").count(), 1, "{md}");
        let back = BenchResults::from_json(&r.json()).unwrap();
        assert_eq!(back.rows[1].slow_path.as_deref(), Some("head_dim 288"));
    }

    /// `kvq bench --replot` reads its file through the guard: a FIFO (which would block the open
    /// forever), a device node (which would read without end) and an oversized file are errors
    /// at once, naming what the path is.
    #[cfg(unix)]
    #[test]
    fn a_fifo_device_or_oversized_results_file_is_an_error_promptly() {
        let dir = std::env::temp_dir().join(format!("kvq-bench-read-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("results.json");
        let read = |path: &std::path::Path| {
            let (tx, rx) = std::sync::mpsc::channel();
            let path = path.to_path_buf();
            std::thread::spawn(move || {
                let _ = tx.send(BenchResults::read_json_file(&path));
            });
            rx.recv_timeout(std::time::Duration::from_secs(10))
                .expect("reading the results did not return within 10 s")
        };

        let r = sample();
        std::fs::write(&path, r.json()).unwrap();
        assert_eq!(read(&path).unwrap().rows, r.rows);

        std::fs::remove_file(&path).unwrap();
        let made = std::process::Command::new("mkfifo").arg(&path).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo {}", path.display());
        let e = read(&path).unwrap_err();
        assert!(e.contains("a FIFO"), "{e}");

        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        let e = read(&path).unwrap_err();
        assert!(e.contains("a character device"), "{e}");

        // Sparse: only the stated size is past the limit.
        std::fs::remove_file(&path).unwrap();
        std::fs::File::create(&path)
            .unwrap()
            .set_len(MAX_RESULTS_FILE_BYTES + 1)
            .unwrap();
        let e = read(&path).unwrap_err();
        assert!(
            e.contains(&format!("{} bytes", MAX_RESULTS_FILE_BYTES + 1)),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Stored scores are named as such, and results written before the field was renamed
    /// (`reread_bytes`, K read again) still load.
    #[test]
    fn extra_bytes_say_what_they_are_and_old_results_load() {
        let mut r = sample();
        r.rows[5].stored_scores = true;
        let md = r.markdown();
        assert!(
            md.contains("- calibquant1 B=1 L=32K: scores the range pass writes and the decode kernel reads back (instead of K), 536.9 MB (+50%)"),
            "{md}"
        );
        assert!(!md.contains("read again by the range pass"));
        // As an older bench wrote it: the field under its old name, no stored_scores.
        let mut old: serde_json::Value = serde_json::from_str(&r.json()).unwrap();
        for row in old["rows"].as_array_mut().unwrap() {
            let row = row.as_object_mut().unwrap();
            let extra = row.remove("extra_bytes").unwrap();
            row.insert("reread_bytes".into(), extra);
            row.remove("stored_scores").unwrap();
        }
        let old = old.to_string();
        let back = BenchResults::from_json(&old).unwrap();
        assert_eq!(back.rows[5].extra_bytes, 1 << 29);
        assert!(!back.rows[5].stored_scores);
    }

    /// The read floor shows as µs and as the step's multiple of it; results written before it
    /// load without it.
    #[test]
    fn read_floor_is_shown_beside_its_row_and_old_results_load() {
        let mut r = sample();
        r.rows[4].read_floor_us = Some(20.0);
        assert_eq!(r.rows[4].times_read_floor(), Some(1.5));
        assert_eq!(r.rows[3].times_read_floor(), None);
        let md = r.markdown();
        assert!(md.contains("| 3.0e-4 | 20.0 | 1.50 |"), "{md}");
        assert!(md.contains("one launch of a plain streaming read"), "{md}");
        let mut old: serde_json::Value = serde_json::from_str(&r.json()).unwrap();
        for row in old["rows"].as_array_mut().unwrap() {
            row.as_object_mut()
                .unwrap()
                .remove("read_floor_us")
                .unwrap();
        }
        let back = BenchResults::from_json(&old.to_string()).unwrap();
        assert!(back.rows.iter().all(|row| row.read_floor_us.is_none()));
    }

    /// A calibrated row names its range grid's splits after the configuration; results written
    /// before the field load without it.
    #[test]
    fn range_splits_follow_the_configuration() {
        let mut r = sample();
        r.rows[5].range_splits = Some(5);
        let md = r.markdown();
        assert!(md.contains("splits 3 range splits 5 |"), "{md}");
        assert_eq!(md.matches("range splits").count(), 1, "{md}");
        let mut old: serde_json::Value = serde_json::from_str(&r.json()).unwrap();
        for row in old["rows"].as_array_mut().unwrap() {
            row.as_object_mut().unwrap().remove("range_splits").unwrap();
        }
        let back = BenchResults::from_json(&old.to_string()).unwrap();
        assert!(back.rows.iter().all(|row| row.range_splits.is_none()));
    }
}
