//! `kvq-fuzz`: runs a target for a while, or replays a saved input. See docs/FUZZING.md.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use clap::Parser;
use kvq_fuzz::exec::{escape, DEFAULT_STACK};
use kvq_fuzz::fuzz::{self, Config, Report};
use kvq_fuzz::Target;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Refuses single allocations above a limit, so an input that makes the code under test ask for
/// absurd memory is an abort the supervisor records (with the size in the message), not a
/// machine driven into swap. Code that checks with `try_reserve` sees an ordinary failure.
struct Guard;

static MAX_ALLOC: AtomicUsize = AtomicUsize::new(1 << 30);

unsafe impl GlobalAlloc for Guard {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > MAX_ALLOC.load(Ordering::Relaxed) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > MAX_ALLOC.load(Ordering::Relaxed) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through this allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > MAX_ALLOC.load(Ordering::Relaxed) {
            return std::ptr::null_mut();
        }
        // SAFETY: `ptr` and `layout` came from `System` through this allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Guard = Guard;

/// Fuzz kvq's scheme parser, reference and codegen, or `kvq eval`'s file reader.
#[derive(Debug, Parser)]
#[command(name = "kvq-fuzz", version)]
struct Args {
    /// What to fuzz.
    #[arg(value_enum)]
    target: Target,
    /// How long to run, in seconds.
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    /// Seed of the input generator (the same seed gives the same inputs).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop after this many inputs.
    #[arg(long)]
    max_inputs: Option<u64>,
    /// Run one saved input (a finding's `.input` file) and report what it gives.
    #[arg(long, value_name = "FILE")]
    replay: Option<PathBuf>,
    /// Where findings are written.
    #[arg(long, default_value = "kvq-fuzz-findings")]
    findings: PathBuf,
    /// Seconds one input may run before it counts as a hang.
    #[arg(long)]
    limit: Option<f64>,
    /// Stack of the thread that runs inputs, in bytes.
    #[arg(long, default_value_t = DEFAULT_STACK)]
    stack: usize,
    /// Largest single allocation, in bytes; a larger one aborts the run (a finding).
    #[arg(long, default_value_t = 1 << 30)]
    max_alloc: usize,
    /// Keep each finding's input as found (skip shrinking it).
    #[arg(long)]
    no_minimize: bool,
    /// Run the loop in this process (an abort then ends the run without a report).
    #[arg(long)]
    in_process: bool,
    /// Print this many generated inputs (escaped, one a line) and exit: what the generator makes.
    #[arg(long, value_name = "N")]
    print_inputs: Option<u64>,
    /// Internal: this process is the supervisor's child.
    #[arg(long, hide = true)]
    child: bool,
    /// Internal: index of the first input.
    #[arg(long, hide = true, default_value_t = 0)]
    start: u64,
}

fn summary(target: Target, report: &Report) -> String {
    let secs = report.elapsed.as_secs_f64();
    let mut s = format!(
        "kvq-fuzz {}: {} inputs ({} past the first gate: {}) in {:.1} s ({:.0}/s), {} finding(s), {} repeat(s)",
        target.name(),
        report.executed,
        report.accepted,
        match target {
            Target::Scheme => "parsed",
            Target::Safetensors => "read",
        },
        secs,
        report.executed as f64 / secs.max(1e-9),
        report.findings.len(),
        report.repeats
    );
    for r in &report.findings {
        s.push_str(&format!(
            "\n  - {} [{}]\n    input: {}\n    saved: {}",
            r.finding,
            r.signature,
            escape(&r.input, 200),
            r.file.display()
        ));
    }
    s
}

fn main() -> ExitCode {
    let args = Args::parse();
    MAX_ALLOC.store(args.max_alloc, Ordering::Relaxed);
    // The library's own guard gets the same bound, so a request past it is the typed error a
    // machine of that size would give, and only an allocation that skips the guard aborts.
    kvq::reference::resources::set_memory_limit(Some(args.max_alloc as u64));
    let limit = args
        .limit
        .map(Duration::from_secs_f64)
        .unwrap_or_else(|| args.target.default_limit());
    if let Some(file) = &args.replay {
        let input = match std::fs::read(file) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("error: cannot read {}: {e}", file.display());
                return ExitCode::from(2);
            }
        };
        println!(
            "replaying {} ({} bytes): {}",
            file.display(),
            input.len(),
            escape(&input, 400)
        );
        return match fuzz::replay(args.target, &input, args.stack, limit) {
            Ok(()) => {
                println!("ok: no finding");
                ExitCode::SUCCESS
            }
            Err(f) => {
                println!("finding: {f}");
                ExitCode::from(1)
            }
        };
    }
    if let Some(n) = args.print_inputs {
        let corpus = args.target.corpus();
        for i in args.start..args.start + n {
            let mut rng = ChaCha8Rng::seed_from_u64(fuzz::input_seed(args.seed, i));
            let input = args.target.generate(&mut rng, &corpus);
            println!("{}", escape(&input, 300));
        }
        return ExitCode::SUCCESS;
    }
    let cfg = Config {
        target: args.target,
        seconds: args.seconds,
        seed: args.seed,
        start: args.start,
        max_inputs: args.max_inputs,
        findings: args.findings.clone(),
        stack: args.stack,
        limit,
        minimize: !args.no_minimize,
        max_alloc: args.max_alloc,
    };
    if args.child {
        let report = fuzz::run_in_process(&cfg, true);
        fuzz::print_child_report(&report);
        return ExitCode::SUCCESS;
    }
    let report = if args.in_process {
        fuzz::run_in_process(&cfg, false)
    } else {
        let exe = match std::env::current_exe() {
            Ok(e) => e,
            Err(e) => {
                eprintln!("error: cannot find this program to start the fuzz child: {e}");
                return ExitCode::from(2);
            }
        };
        match fuzz::supervise(&cfg, &exe) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(1);
            }
        }
    };
    println!("{}", summary(args.target, &report));
    if report.findings.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
