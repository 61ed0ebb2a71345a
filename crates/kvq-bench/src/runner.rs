//! The measurement loop: copy bandwidth, then every context length × batch × scheme, each timed
//! on rotating copies with queued CUDA-event timing, checked against the CPU reference, and
//! optionally tuned and re-timed against its default.

use std::sync::Arc;

use kvq::codegen::{has_codebook_kernel, has_xquant_kernel, Dtype, KernelShape, TuneParams};
use kvq::reference::commvq::CommVqCache;
use kvq::reference::int::IntCache;
use kvq::reference::xquant::XQuantCache;
use kvq::runtime::codebook::{CodebookCache, CodebookKernel, CodebookScratch};
use kvq::runtime::cudarc::driver::{CudaSlice, CudaStream};
use kvq::runtime::tune::{
    batch_device_bytes, default_launch_with, plan_copies, ReferenceCheck, RotatingBatch,
    TuneChoice, TunePolicy, TuneProblem, TuneStore, Tuner,
};
use kvq::runtime::xquant::{
    rebuild_text, xquant_cache_bytes, xquant_choice, XQuantDeviceCache, XQuantKernel, XQuantScratch,
};
use kvq::runtime::{DecodeKernel, DecodeScratch, GpuTimer, Jit, Pieces, RuntimeError, Timing};

use crate::bytes::{decode_bytes, extra_bytes, xquant_decode_bytes, xquant_rebuild_flop};
use crate::copy::copy_bandwidth;
use crate::date::utc_date;
use crate::error::{BenchError, Result};
use crate::grid::{format_tokens, BenchConfig, Scheme};
use crate::read_floor::ReadFloor;
use crate::report::{BenchResults, Row, Skipped, TunedResult};
use crate::workload::{
    checked_rows, prepare, Prepared, PreparedCache, QueryRows, XQUANT_PRECISION,
};

/// Device memory left free for the driver, the scratch and the tuner's own buffers.
const RESERVE: u64 = 2 << 30;

/// Interleaved rounds when a default and a tuned configuration are compared (drift hits both).
const ROUNDS: usize = 3;

/// What one shape produced.
enum Outcome {
    Measured(Box<Row>),
    Skipped(String),
}

/// Shared state of a run.
struct Context<'a> {
    config: &'a BenchConfig,
    jit: &'a Jit,
    stream: Arc<CudaStream>,
    shape: KernelShape,
    timer: GpuTimer,
    queries: QueryRows,
    copy_gbps: f64,
    read_floor: ReadFloor,
    tuner: Option<Tuner<'a>>,
}

/// Runs the whole grid of `config` on `jit`'s GPU; `log` receives one line per step.
pub fn run(
    config: &BenchConfig,
    jit: &Jit,
    label: Option<String>,
    log: &mut dyn FnMut(&str),
) -> Result<BenchResults> {
    let device = jit.device();
    let props = device.props().clone();
    let gqa = config.gqa()?;
    let shape = KernelShape::new(config.head_dim, gqa, config.dtype);
    // Codebook and XQuant decodes check their shapes when their kernels are generated.
    for s in config
        .schemes
        .iter()
        .filter(|s| !has_codebook_kernel(&s.spec) && !has_xquant_kernel(&s.spec))
    {
        TuneProblem::new(s.spec, shape, config.kv_heads, 1, 1).check()?;
    }
    if config.d_model == 0 {
        return Err(BenchError::Usage(
            "a layer input of width 0 (--d-model)".into(),
        ));
    }
    if config.batches.is_empty() || config.contexts.is_empty() {
        return Err(BenchError::Usage("no batch size or context length".into()));
    }
    let stream = device.default_stream();
    log(&format!("{props}"));
    let _pad = set_aside(&stream, config.placement_pad, log)?;

    let timer = GpuTimer::new(jit)?;
    let copy = copy_bandwidth(&stream, &timer, config.copy_bytes, 10)?;
    log(&format!(
        "copy bandwidth: {:.0} GB/s ({:.1} GiB device-to-device, median {:.0} µs)",
        copy.gbps,
        copy.bytes as f64 / (1u64 << 30) as f64,
        copy.median_us
    ));

    compile_defaults(jit, &config.schemes, shape)?;
    log(&format!("kernels ready: {}", jit.stats()));
    let tuner = if config.tune {
        let store = TuneStore::open(TuneStore::default_path()?);
        log(&format!("tuning results go to {}", store.path().display()));
        Some(Tuner::with_store(jit, TunePolicy::Full, store))
    } else {
        None
    };
    let max_batch = config.batches.iter().copied().max().unwrap_or(1);
    let mut ctx = Context {
        config,
        jit,
        stream,
        shape,
        timer,
        queries: QueryRows::new(
            max_batch,
            config.q_heads,
            config.head_dim as usize,
            config.dtype,
            config.seed,
        )?,
        copy_gbps: copy.gbps,
        read_floor: ReadFloor::new(jit)?,
        tuner,
    };
    let rows_to_check = checked_rows(&config.batches);
    let unix_time = kvq::runtime::tune::store::unix_now();
    let mut results = BenchResults {
        gpu: props,
        date: utc_date(unix_time),
        unix_time,
        label,
        shape: format!(
            "{} query heads, {} KV heads, head_dim {}, {}",
            config.q_heads, config.kv_heads, config.head_dim, config.dtype
        ),
        copy,
        rows: Vec::new(),
        skipped: Vec::new(),
    };
    for &len in &config.contexts {
        let started = std::time::Instant::now();
        let prepared = prepare(config, len, &ctx.queries, &rows_to_check)?;
        log(&format!(
            "L={}: {} reference caches built in {:.1} s",
            format_tokens(len),
            prepared.len(),
            started.elapsed().as_secs_f64()
        ));
        for &batch in &config.batches {
            for prep in &prepared {
                let outcome = ctx
                    .measure(prep, batch, len)
                    .unwrap_or_else(|e| Outcome::Skipped(format!("error: {e}")));
                match outcome {
                    Outcome::Measured(mut row) => {
                        row.read_floor_us = ctx.read_floor(&row, log);
                        log(&describe(&row));
                        results.rows.push(*row);
                    }
                    Outcome::Skipped(reason) => {
                        log(&format!(
                            "{} B={batch} L={}: not measured: {reason}",
                            prep.scheme.name,
                            format_tokens(len)
                        ));
                        results.skipped.push(Skipped {
                            scheme: prep.scheme.name.clone(),
                            batch,
                            context: len,
                            reason,
                        });
                    }
                }
            }
        }
    }
    results.fill_speedups();
    Ok(results)
}

fn describe(r: &Row) -> String {
    let mut s = format!(
        "{} B={} L={}: {:.1} µs, {:.0} GB/s ({:.1}% of copy), {}, {} copies",
        r.scheme,
        r.batch,
        format_tokens(r.context),
        r.median_us,
        r.gbps,
        r.pct_of_copy,
        r.choice,
        r.copies
    );
    if let Some(e) = r.max_rel_error {
        s.push_str(&format!(", rel err {e:.1e}"));
    }
    if let (Some(floor), Some(times)) = (r.read_floor_us, r.times_read_floor()) {
        s.push_str(&format!("; one-launch read {floor:.1} µs (×{times:.2})"));
    }
    if let Some(t) = &r.tuned {
        s.push_str(&format!(
            "; tuned {} {:.1} µs (×{:.3}) in {:.1} s",
            t.choice, t.median_us, t.gain, t.tune_seconds
        ));
    }
    s
}

/// Every scheme's kernel with the default block parameters, compiled on all cores into the JIT's
/// module cache (so compile errors show before any timing, and later loads are cache hits).
fn compile_defaults(jit: &Jit, schemes: &[Scheme], shape: KernelShape) -> Result<()> {
    let results: Vec<std::result::Result<DecodeKernel, RuntimeError>> = std::thread::scope(|s| {
        let handles: Vec<_> = schemes
            .iter()
            .filter(|sc| !has_codebook_kernel(&sc.spec) && !has_xquant_kernel(&sc.spec))
            .map(|sc| {
                s.spawn(move || {
                    let params = TuneParams::default_for(&sc.spec, &shape);
                    DecodeKernel::load_with(
                        jit,
                        &sc.spec,
                        &shape,
                        &params,
                        kvq::runtime::LoadOptions::ALLOW_SLOW_PATH,
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(RuntimeError::InvalidInput(
                        "a compile thread panicked".into(),
                    ))
                })
            })
            .collect()
    });
    results
        .into_iter()
        .collect::<std::result::Result<Vec<_>, _>>()
        .map(drop)
        .map_err(BenchError::from)
}

/// Allocates `bytes` of device memory (none for 0), held until the run ends, so that the run's
/// buffers land past it.
fn set_aside(
    stream: &Arc<CudaStream>,
    bytes: u64,
    log: &mut dyn FnMut(&str),
) -> Result<Option<CudaSlice<u8>>> {
    if bytes == 0 {
        return Ok(None);
    }
    // SAFETY: the pad is never read or written.
    let pad = unsafe { stream.alloc::<u8>(bytes as usize) }
        .map_err(|e| RuntimeError::driver("set aside the placement pad", e))?;
    log(&format!(
        "placement pad: {} MiB set aside before every other buffer",
        bytes >> 20
    ));
    Ok(Some(pad))
}

/// The prepared reference outputs of the rows a batch of `batch` holds (whole rows, or the part
/// the scheme's reference covers).
fn reference_rows(prep: &Prepared, batch: usize, row_len: usize, dtype: Dtype) -> ReferenceCheck {
    let rows = prep
        .reference
        .iter()
        .filter(|(row, _)| *row < batch)
        .cloned()
        .collect();
    ReferenceCheck::from_row_parts(rows, row_len, prep.reference_offset, dtype)
}

/// Poisons `out` (NaN in every word, so an output the kernel never writes fails), runs `launch`
/// into it and checks the result against `reference`: the largest error, or why it is wrong.
fn checked_launch(
    stream: &Arc<CudaStream>,
    out: &mut CudaSlice<u16>,
    reference: &ReferenceCheck,
    launch: impl FnOnce(&mut CudaSlice<u16>) -> std::result::Result<(), RuntimeError>,
) -> Result<std::result::Result<f64, String>> {
    let poison = vec![0x7e00u16; out.len()];
    stream
        .memcpy_htod(&poison, out)
        .map_err(|e| RuntimeError::driver("poison the output", e))?;
    launch(out)?;
    let host: Vec<u16> = stream
        .clone_dtoh(out)
        .map_err(|e| RuntimeError::driver("download the output", e))?;
    Ok(reference.verify(&host))
}

fn too_big(bytes: u64, budget: u64) -> Outcome {
    Outcome::Skipped(format!(
        "needs {:.1} GiB of device memory, the budget is {:.1} GiB",
        bytes as f64 / (1u64 << 30) as f64,
        budget as f64 / (1u64 << 30) as f64
    ))
}

impl Context<'_> {
    /// The read floor of `row`'s bytes over as many copies as its step rotated through; `None`
    /// (logged) where it could not be measured, e.g. for want of device memory beside the run's.
    fn read_floor(&self, row: &Row, log: &mut dyn FnMut(&str)) -> Option<f64> {
        let measured = self.read_floor.median_us(
            &self.stream,
            &self.timer,
            row.bytes,
            row.copies,
            self.config.warmup,
            self.config.runs,
        );
        match measured {
            Ok(us) => Some(us),
            Err(e) => {
                log(&format!(
                    "{} B={} L={}: read floor not measured: {e}",
                    row.scheme,
                    row.batch,
                    format_tokens(row.context)
                ));
                None
            }
        }
    }

    /// The step's samples for the default launch and, where `tuned`, the tuned one:
    /// `launch(stream, tuned_launch)` enqueues one step, in one round of the configured runs, or
    /// in ROUNDS interleaved rounds of both so drift hits them alike.
    fn time_default_and_tuned(
        &self,
        stream: &Arc<CudaStream>,
        tuned: bool,
        mut launch: impl FnMut(&Arc<CudaStream>, bool) -> std::result::Result<(), RuntimeError>,
    ) -> Result<(Vec<f64>, Vec<f64>)> {
        let config = self.config;
        let rounds = if tuned { ROUNDS } else { 1 };
        let per_round = config.runs.max(rounds).div_ceil(rounds);
        let (mut base, mut fast) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let t = self
                .timer
                .time(stream, config.warmup, per_round, |s| launch(s, false))?;
            base.extend(t.samples_us);
            if tuned {
                let t = self
                    .timer
                    .time(stream, config.warmup, per_round, |s| launch(s, true))?;
                fast.extend(t.samples_us);
            }
        }
        Ok((base, fast))
    }

    /// Device memory a shape may take: the configured budget, within what is free.
    fn memory_budget(&self) -> Result<u64> {
        let (free, _) = self
            .jit
            .device()
            .context()
            .mem_get_info()
            .map_err(|e| RuntimeError::driver("cuMemGetInfo", e))?;
        Ok(self
            .config
            .memory_budget
            .min((free as u64).saturating_sub(RESERVE)))
    }

    /// Measures one scheme at one batch size and context length.
    fn measure(&mut self, prep: &Prepared, batch: usize, len: usize) -> Result<Outcome> {
        let cache: &IntCache = match &prep.cache {
            PreparedCache::Int(c) => c,
            PreparedCache::Codebook(c) => return self.measure_codebook(prep, c, batch, len),
            PreparedCache::XQuant(c) => return self.measure_xquant(prep, c, batch, len),
        };
        let config = self.config;
        let device = self.jit.device();
        let props = device.props();
        let stream = self.stream.clone();
        let (q_heads, d) = (config.q_heads, config.head_dim as usize);
        let sequences = vec![cache; batch];
        let per_copy = batch_device_bytes(&sequences, q_heads);
        let budget = self.memory_budget()?;
        if per_copy > budget {
            return Ok(too_big(per_copy, budget));
        }
        let copies = plan_copies(per_copy, props.l2_bytes, budget)?;
        let mut rotation =
            RotatingBatch::upload(&stream, &sequences, self.queries.bits_for(batch), copies)?;
        let problem = TuneProblem::new(prep.scheme.spec, self.shape, config.kv_heads, batch, len);
        // The heuristic's block and its variant depend on the batch shape and the context
        // bucket (FP16's and KIVI-4's blocks at few pairs, KIVI-4's short staging path where
        // warps' shares are long).
        let (default, kernel) = default_launch_with(self.jit, &problem, &config.launch)?;
        let kernel = &kernel;
        let stores_scores = kernel.generated().stores_scores;
        let mut scratch =
            DecodeScratch::with_pieces(&stream, batch, q_heads, d, default.splits, default.pieces)?;
        let reference = reference_rows(prep, batch, q_heads * d, config.dtype);
        let max_rel_error = if config.check {
            let out = rotation.run_checked(0, &stream, kernel, &mut scratch)?;
            match reference.verify(&out) {
                Ok(e) => Some(e),
                Err(why) => {
                    return Ok(Outcome::Skipped(format!("WRONG OUTPUT ({default}): {why}")))
                }
            }
        } else {
            None
        };

        // The tuner's choice, checked like the default.
        let mut tuned = None;
        if let Some(tuner) = self.tuner.as_mut() {
            let report = tuner.tune_on(self.shape, &sequences)?;
            let tk = DecodeKernel::load_with(
                self.jit,
                &prep.scheme.spec,
                &self.shape,
                &report.chosen.params,
                kvq::runtime::LoadOptions::ALLOW_SLOW_PATH,
            )?;
            let mut ts = DecodeScratch::with_pieces(
                &stream,
                batch,
                q_heads,
                d,
                report.chosen.splits,
                report.chosen.pieces,
            )?;
            if config.check {
                let out = rotation.run_checked(0, &stream, &tk, &mut ts)?;
                if let Err(why) = reference.verify(&out) {
                    return Ok(Outcome::Skipped(format!(
                        "WRONG OUTPUT from the tuned {}: {why}",
                        report.chosen
                    )));
                }
            }
            tuned = Some((report, tk, ts));
        }

        let (base, fast) =
            self.time_default_and_tuned(&stream, tuned.is_some(), |s, tuned_launch| {
                match (tuned_launch, tuned.as_mut()) {
                    (true, Some((_, tk, ts))) => rotation.attend_next(s, tk, ts),
                    _ => rotation.attend_next(s, kernel, &mut scratch),
                }
            })?;
        let stats = Timing { samples_us: base };
        let median_us = stats.median_us();
        let bytes = decode_bytes(&sequences, q_heads);
        let gbps = bytes as f64 / (median_us * 1e-6) / 1e9;
        let tuned = tuned.map(|(report, _, _)| {
            let t = Timing { samples_us: fast }.median_us();
            TunedResult {
                choice: report.chosen,
                median_us: t,
                gain: median_us / t,
                tune_seconds: report.elapsed.as_secs_f64(),
                candidates: report.candidates.len(),
                rejected: report.rejected(),
            }
        });
        let slow_path = kernel.generated().slow_path.map(|why| why.to_string());
        Ok(Outcome::Measured(Box::new(Row {
            slow_path,
            scheme: prep.scheme.name.clone(),
            batch,
            context: len,
            choice: default,
            range_splits: kernel
                .generated()
                .range
                .is_some()
                .then(|| kernel.range_splits(default.splits)),
            median_us,
            min_us: stats.min_us(),
            bytes,
            extra_bytes: extra_bytes(
                &sequences,
                stores_scores.then(|| kernel.generated().score_columns() as usize),
            ),
            stored_scores: stores_scores,
            gbps,
            pct_of_copy: 100.0 * gbps / self.copy_gbps,
            speedup_vs_fp16: None,
            max_rel_error,
            copies: rotation.copies(),
            read_floor_us: None,
            tuned,
            rebuild: None,
            rebuild_flop: None,
        })))
    }

    /// Measures a codebook scheme (its own kernel): `batch` copies of the prepared sequence, as
    /// many batches as keep the rotation past L2, the default launch, and with `--tune` the
    /// tuner's choice timed against it in interleaved rounds.
    fn measure_codebook(
        &mut self,
        prep: &Prepared,
        cache: &CommVqCache,
        batch: usize,
        len: usize,
    ) -> Result<Outcome> {
        let config = self.config;
        let stream = self.stream.clone();
        let (q_heads, d) = (config.q_heads, config.head_dim as usize);
        let kernel =
            CodebookKernel::load(self.jit, &prep.scheme.spec, &self.shape, config.kv_heads)?;
        let sequences = vec![cache.clone(); batch];
        let theta = cache.rope().theta;
        let first = CodebookCache::upload(&stream, kernel.layout(), &sequences, theta)?;
        let per_copy = first.cache_bytes() as u64;
        let budget = self.memory_budget()?;
        if per_copy > budget {
            return Ok(too_big(per_copy, budget));
        }
        let copies = plan_copies(per_copy, self.jit.device().props().l2_bytes, budget)?;
        let mut batches = vec![first];
        for _ in 1..copies {
            batches.push(CodebookCache::upload(
                &stream,
                kernel.layout(),
                &sequences,
                theta,
            )?);
        }
        let rows = batch * q_heads * d;
        let q = stream
            .clone_htod(self.queries.bits_for(batch))
            .map_err(|e| RuntimeError::driver("upload the queries", e))?;
        // NaN in every word: an output the kernel never writes fails the check.
        let mut out = stream
            .clone_htod(&vec![0x7e00u16; rows])
            .map_err(|e| RuntimeError::driver("allocate the output", e))?;
        let splits = kernel.default_splits(batch, len);
        let mut scratch = CodebookScratch::new(&stream)?;
        let reference = reference_rows(prep, batch, q_heads * d, config.dtype);
        let mut check = |k: &CodebookKernel, splits: usize, scratch: &mut CodebookScratch| {
            checked_launch(&stream, &mut out, &reference, |out| {
                k.attend(&stream, &batches[0], &q, out, splits, scratch)
            })
        };
        let max_rel_error = if config.check {
            match check(&kernel, splits, &mut scratch)? {
                Ok(e) => Some(e),
                Err(why) => return Ok(Outcome::Skipped(format!("WRONG OUTPUT: {why}"))),
            }
        } else {
            None
        };
        // The tuner's choice, checked like the default.
        let mut tuned = None;
        if let Some(tuner) = self.tuner.as_mut() {
            let started = std::time::Instant::now();
            let problem =
                TuneProblem::new(prep.scheme.spec, self.shape, config.kv_heads, batch, len);
            let refs: Vec<&CodebookCache> = batches.iter().collect();
            let report = tuner.tune_codebook_on(&problem, &refs, &q)?;
            let tk = CodebookKernel::load_with(
                self.jit,
                &prep.scheme.spec,
                &self.shape,
                config.kv_heads,
                &report.chosen.params,
            )?;
            let mut ts = CodebookScratch::new(&stream)?;
            if config.check {
                if let Err(why) = check(&tk, report.chosen.splits, &mut ts)? {
                    return Ok(Outcome::Skipped(format!(
                        "WRONG OUTPUT from the tuned {}: {why}",
                        report.chosen
                    )));
                }
            }
            tuned = Some((report, tk, ts, started.elapsed()));
        }
        let mut next = 0;
        let (base, fast) =
            self.time_default_and_tuned(&stream, tuned.is_some(), |s, tuned_launch| {
                next = (next + 1) % batches.len();
                match (tuned_launch, tuned.as_mut()) {
                    (true, Some((report, tk, ts, _))) => {
                        tk.attend(s, &batches[next], &q, &mut out, report.chosen.splits, ts)
                    }
                    _ => kernel.attend(s, &batches[next], &q, &mut out, splits, &mut scratch),
                }
            })?;
        let stats = Timing { samples_us: base };
        let median_us = stats.median_us();
        let bytes = batches[0].read_bytes() + 2 * 2 * rows as u64;
        let choice = TuneChoice {
            params: TuneParams {
                threads: kernel.generated().decode.block,
                tile_tokens: kernel.generated().tile,
                min_warps_per_sm: 0,
                pack_heads: false,
                short_staging: false,
                store_scores: false,
            },
            splits,
            pieces: Pieces::default(),
        };
        let tuned = tuned.map(|(report, _, _, took)| {
            let t = Timing { samples_us: fast }.median_us();
            TunedResult {
                choice: report.chosen.as_tune_choice(),
                median_us: t,
                gain: median_us / t,
                tune_seconds: took.as_secs_f64(),
                candidates: report.candidates,
                rejected: report.rejected,
            }
        });
        let cell = (prep.scheme.name.clone(), batch, len);
        let row = self.own_kernel_row(
            cell,
            choice,
            &stats,
            bytes,
            (max_rel_error, batches.len()),
            tuned,
        );
        Ok(Outcome::Measured(Box::new(row)))
    }

    /// A measured row of a family with a kernel of its own (codebook, XQuant): `cell` is the
    /// scheme's name, batch and context; the time's statistics and the bytes a step reads give
    /// the rate; the error checked and the batches rotated through; the tuned launch's result.
    fn own_kernel_row(
        &self,
        (scheme, batch, context): (String, usize, usize),
        choice: TuneChoice,
        stats: &Timing,
        bytes: u64,
        (max_rel_error, copies): (Option<f64>, usize),
        tuned: Option<TunedResult>,
    ) -> Row {
        let median_us = stats.median_us();
        let gbps = bytes as f64 / (median_us * 1e-6) / 1e9;
        Row {
            slow_path: None,
            scheme,
            batch,
            context,
            choice,
            range_splits: None,
            median_us,
            min_us: stats.min_us(),
            bytes,
            extra_bytes: 0,
            stored_scores: false,
            gbps,
            pct_of_copy: 100.0 * gbps / self.copy_gbps,
            speedup_vs_fp16: None,
            max_rel_error,
            copies,
            read_floor_us: None,
            tuned,
            rebuild: None,
            rebuild_flop: None,
        }
    }

    /// Measures an XQuant scheme (its own kernel, K rebuilt at [`XQUANT_PRECISION`]): `batch`
    /// copies of the prepared sequence of random latents, as many batches as keep the rotation
    /// past L2, the split count the tuner's policy would not change (the default's), and with
    /// `--tune` the tuner's split count timed against it in interleaved rounds.
    fn measure_xquant(
        &mut self,
        prep: &Prepared,
        cache: &XQuantCache,
        batch: usize,
        len: usize,
    ) -> Result<Outcome> {
        let config = self.config;
        let stream = self.stream.clone();
        let (q_heads, d) = (config.q_heads, config.head_dim as usize);
        let spec = prep.scheme.spec;
        let kernel = XQuantKernel::load(
            self.jit,
            &spec,
            &self.shape,
            config.kv_heads,
            cache.projections().d_model(),
            XQUANT_PRECISION,
        )?;
        let sequences = vec![cache.clone(); batch];
        let first = XQuantDeviceCache::upload(&stream, &sequences)?;
        let per_copy = xquant_cache_bytes(&first);
        let budget = self.memory_budget()?;
        if per_copy > budget {
            return Ok(too_big(per_copy, budget));
        }
        let copies = plan_copies(per_copy, self.jit.device().props().l2_bytes, budget)?;
        let mut batches = vec![first];
        for _ in 1..copies {
            batches.push(XQuantDeviceCache::upload(&stream, &sequences)?);
        }
        drop(sequences);
        let rows = batch * q_heads * d;
        let q = stream
            .clone_htod(self.queries.bits_for(batch))
            .map_err(|e| RuntimeError::driver("upload the queries", e))?;
        let mut out = stream
            .clone_htod(&vec![0x7e00u16; rows])
            .map_err(|e| RuntimeError::driver("allocate the output", e))?;
        let splits = kernel.default_splits(batch, len);
        let mut scratch = XQuantScratch::new(&stream)?;
        let reference = reference_rows(prep, batch, q_heads * d, config.dtype);
        let mut check = |splits: usize, scratch: &mut XQuantScratch| {
            checked_launch(&stream, &mut out, &reference, |out| {
                kernel.attend(&stream, &batches[0], &q, out, splits, scratch)
            })
        };
        let max_rel_error = if config.check {
            match check(splits, &mut scratch)? {
                Ok(e) => Some(e),
                Err(why) => return Ok(Outcome::Skipped(format!("WRONG OUTPUT: {why}"))),
            }
        } else {
            None
        };
        // The tuner's split count, checked like the default.
        let mut tuned = None;
        if let Some(tuner) = self.tuner.as_mut() {
            let problem = TuneProblem::new(spec, self.shape, config.kv_heads, batch, len);
            let refs: Vec<&XQuantDeviceCache> = batches.iter().collect();
            let report = tuner.tune_xquant_on(&problem, &kernel, &refs, &q)?;
            let mut ts = XQuantScratch::new(&stream)?;
            if config.check {
                if let Err(why) = check(report.chosen, &mut ts)? {
                    return Ok(Outcome::Skipped(format!(
                        "WRONG OUTPUT from the tuned {} splits: {why}",
                        report.chosen
                    )));
                }
            }
            tuned = Some((report, ts));
        }
        let mut next = 0;
        let (base, fast) =
            self.time_default_and_tuned(&stream, tuned.is_some(), |s, tuned_launch| {
                next = (next + 1) % batches.len();
                let (chosen, ts) = match (tuned_launch, tuned.as_mut()) {
                    (true, Some((report, ts))) => (report.chosen, ts),
                    _ => (splits, &mut scratch),
                };
                kernel.attend(s, &batches[next], &q, &mut out, chosen, ts)
            })?;
        let stats = Timing { samples_us: base };
        let median_us = stats.median_us();
        let bytes = xquant_decode_bytes(cache, batch, q_heads, XQUANT_PRECISION);
        let tuned = tuned.map(|(report, _)| {
            let t = Timing { samples_us: fast }.median_us();
            TunedResult {
                choice: xquant_choice(&kernel, report.chosen),
                median_us: t,
                gain: median_us / t,
                tune_seconds: report.elapsed.as_secs_f64(),
                candidates: report.candidates.len(),
                rejected: report.rejected(),
            }
        });
        let cell = (prep.scheme.name.clone(), batch, len);
        let choice = xquant_choice(&kernel, splits);
        let row = self.own_kernel_row(
            cell,
            choice,
            &stats,
            bytes,
            (max_rel_error, batches.len()),
            tuned,
        );
        Ok(Outcome::Measured(Box::new(Row {
            rebuild: Some(rebuild_text(kernel.generated())),
            rebuild_flop: Some(xquant_rebuild_flop(cache, batch)),
            ..row
        })))
    }
}
