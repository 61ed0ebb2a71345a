//! The fuzz loop (in one process) and its supervisor (a parent process that restarts the loop
//! after an abort and records the input that caused it).
//!
//! Input `i` of a run with seed `s` comes from a generator seeded with `mix(s, i)`, so a run
//! resumes after a crash at `i + 1` and the same seed gives the same inputs (the scheme target
//! also mutates texts it has seen parse, which depend on the run so far).

use std::collections::HashSet;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::exec::{escape, Executor, Finding, Kind};
use crate::Target;

/// How a run is set up.
#[derive(Debug, Clone)]
pub struct Config {
    pub target: Target,
    /// Wall-clock budget of the whole run.
    pub seconds: f64,
    pub seed: u64,
    /// Index of the first input (a restarted child resumes here).
    pub start: u64,
    /// Stop after this many inputs (none: run until the time is up).
    pub max_inputs: Option<u64>,
    /// Where findings are written (created if missing).
    pub findings: PathBuf,
    /// Worker thread stack in bytes.
    pub stack: usize,
    /// Per-input time limit.
    pub limit: Duration,
    /// Shrink each new finding's input while it still gives the same finding.
    pub minimize: bool,
    /// Largest single allocation the child processes allow (`--max-alloc`; enforced by the
    /// binary's allocator).
    pub max_alloc: usize,
}

/// One distinct finding of a run.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub finding: Finding,
    pub signature: String,
    /// The (possibly minimized) input that gives it.
    pub input: Vec<u8>,
    /// The input's file in the findings folder (replay it with `--replay`).
    pub file: PathBuf,
}

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub executed: u64,
    pub elapsed: Duration,
    /// Distinct findings, in the order found.
    pub findings: Vec<Recorded>,
    /// Inputs that got past the first gate ([`Target::accepted`]).
    pub accepted: u64,
    /// Inputs that gave an already recorded finding.
    pub repeats: u64,
    /// Index of the next input.
    pub next: u64,
    /// The loop stopped at a hang (its worker thread is still running).
    pub hung: bool,
}

/// The generator seed of input `i`: SplitMix64 of the run seed and the index.
pub fn input_seed(seed: u64, i: u64) -> u64 {
    let mut z = seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Bytes before the input in a marker file.
const MARKER_HEAD: usize = 24;

/// The file a child writes each input to before running it, for the supervisor to read after
/// an abort: the input's index, the inputs the child saw accepted and repeated so far (8 bytes
/// each, little-endian), then the input.
pub fn marker_path(findings: &Path, target: Target) -> PathBuf {
    findings.join(format!(".current-{}", target.name()))
}

/// Signatures recorded earlier in this session (by an earlier child), one a line.
fn session_path(findings: &Path, target: Target) -> PathBuf {
    findings.join(format!(".session-{}", target.name()))
}

/// Writes a finding's input and description; returns the input's path.
pub fn write_finding(
    dir: &Path,
    target: Target,
    finding: &Finding,
    signature: &str,
    input: &[u8],
) -> PathBuf {
    let _ = fs::create_dir_all(dir);
    let stem = format!(
        "{}-{}-{:016x}",
        target.name(),
        finding.kind,
        fnv(signature.as_bytes())
    );
    let file = dir.join(format!("{stem}.input"));
    let _ = fs::write(&file, input);
    let text = format!(
        "target: {}\nkind: {}\nlocation: {}\nmessage: {}\nsignature: {signature}\ninput ({} bytes, escaped): {}\nreplay: kvq-fuzz {} --replay {}\n",
        target.name(),
        finding.kind,
        finding.location.as_deref().unwrap_or("-"),
        finding.message,
        input.len(),
        escape(input, 4096),
        target.name(),
        file.display()
    );
    let _ = fs::write(dir.join(format!("{stem}.txt")), text);
    file
}

/// Writes a new finding's files and prints it.
fn record(cfg: &Config, finding: Finding, signature: String, input: Vec<u8>) -> Recorded {
    let file = write_finding(&cfg.findings, cfg.target, &finding, &signature, &input);
    let r = Recorded {
        finding,
        signature,
        input,
        file,
    };
    print_finding(cfg.target, &r);
    r
}

/// Adds a finding's signature to the session file, so a restarted child counts it as seen.
fn remember(session: &Path, signature: &str) {
    if let Ok(mut f) = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(session)
    {
        let _ = writeln!(f, "{signature}");
    }
}

/// Prints a finding for the terminal.
pub fn print_finding(target: Target, r: &Recorded) {
    eprintln!(
        "\n=== finding ({}): {}\n    input ({} bytes): {}\n    saved: {}\n",
        target.name(),
        r.finding,
        r.input.len(),
        escape(&r.input, 600),
        r.file.display()
    );
}

/// Shrinks `input` while it gives a finding of the same signature (drops chunks of halving size).
fn minimize(
    exec: &mut Executor,
    target: Target,
    input: &[u8],
    signature: &str,
    budget: Duration,
) -> Vec<u8> {
    let started = Instant::now();
    let mut best = input.to_vec();
    let mut chunk = (best.len() / 2).max(1);
    while chunk >= 1 && started.elapsed() < budget {
        let mut i = 0;
        let mut shrank = false;
        while i < best.len() && started.elapsed() < budget {
            let end = (i + chunk).min(best.len());
            let mut candidate = best[..i].to_vec();
            candidate.extend_from_slice(&best[end..]);
            match exec.run(target.check(), &candidate) {
                Err(f) if f.signature() == signature => {
                    best = candidate;
                    shrank = true;
                }
                Err(f) if f.kind == Kind::Hang => return best,
                _ => i += chunk,
            }
        }
        if !shrank {
            if chunk == 1 {
                break;
            }
            chunk /= 2;
        }
    }
    best
}

/// Runs the loop in this process until the time or input budget is spent, or an input hangs.
/// With `marker`, each input is written there first (see [`marker_path`]).
pub fn run_in_process(cfg: &Config, marker: bool) -> Report {
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(cfg.seconds.max(0.0));
    let accepted_before = cfg.target.accepted();
    let mut exec = Executor::new(cfg.stack, cfg.limit);
    let mut corpus = cfg.target.corpus();
    let fixed = corpus.len();
    let session = session_path(&cfg.findings, cfg.target);
    let mut seen: HashSet<String> = fs::read_to_string(&session)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect();
    let marker_file = marker_path(&cfg.findings, cfg.target);
    if marker {
        let _ = fs::create_dir_all(&cfg.findings);
    }
    let mut report = Report {
        next: cfg.start,
        ..Default::default()
    };
    let mut i = cfg.start;
    while Instant::now() < deadline && cfg.max_inputs.map_or(true, |m| report.executed < m) {
        let mut rng = ChaCha8Rng::seed_from_u64(input_seed(cfg.seed, i));
        let input = cfg.target.generate(&mut rng, &corpus);
        if marker {
            let accepted = cfg.target.accepted() - accepted_before;
            let mut bytes = i.to_le_bytes().to_vec();
            bytes.extend_from_slice(&accepted.to_le_bytes());
            bytes.extend_from_slice(&report.repeats.to_le_bytes());
            bytes.extend_from_slice(&input);
            let _ = fs::write(&marker_file, bytes);
        }
        let outcome = exec.run(cfg.target.check(), &input);
        report.executed += 1;
        i += 1;
        report.next = i;
        match outcome {
            Ok(()) => {
                // Texts that parse join the corpus, so mutations explore near valid schemes.
                if cfg.target == Target::Scheme && input.len() < 2048 {
                    let text = String::from_utf8_lossy(&input);
                    if kvq::SchemeSpec::parse(&text).is_ok() {
                        if corpus.len() < fixed + 256 {
                            corpus.push(input);
                        } else {
                            let slot = fixed + (i as usize % 256);
                            corpus[slot] = input;
                        }
                    }
                }
            }
            Err(finding) => {
                let hung = finding.kind == Kind::Hang;
                let signature = finding.signature();
                if seen.insert(signature.clone()) {
                    let input = if cfg.minimize && !hung {
                        minimize(
                            &mut exec,
                            cfg.target,
                            &input,
                            &signature,
                            Duration::from_secs(10),
                        )
                    } else {
                        input
                    };
                    let r = record(cfg, finding, signature, input);
                    if marker {
                        // Now, not at the end: the child may yet die of a later input.
                        println!(
                            "KVQ_FUZZ_FINDING\t{}\t{}\t{}",
                            r.finding.kind,
                            r.file.display(),
                            r.signature
                        );
                        remember(&session, &r.signature);
                    }
                    report.findings.push(r);
                } else {
                    report.repeats += 1;
                }
                if hung {
                    report.hung = true;
                    break;
                }
            }
        }
    }
    report.accepted = cfg.target.accepted() - accepted_before;
    report.elapsed = started.elapsed();
    report
}

/// Why a child died, from its stderr: the runtime's last words (failed allocation, stack
/// overflow) and, where a backtrace was printed, the first frame in kvq's code outside this crate.
fn death(stderr: &str, status: &std::process::ExitStatus) -> (String, Option<String>) {
    let lines: Vec<&str> = stderr
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    const LAST_WORDS: [&str; 4] = [
        "memory allocation of",
        "has overflowed its stack",
        "fatal runtime error",
        "panicked at",
    ];
    let said = |l: &str| LAST_WORDS.iter().any(|w| l.contains(w));
    // The start of the last run of such lines (an overflow is two: the thread's, the runtime's).
    let key = lines.iter().rposition(|l| said(l)).map(|mut i| {
        while i > 0 && said(lines[i - 1]) {
            i -= 1;
        }
        i
    });
    let words = match key {
        Some(i) => lines[i..]
            .iter()
            .take_while(|l| said(l))
            .copied()
            .collect::<Vec<_>>()
            .join(" / "),
        None => lines[lines.len().saturating_sub(2)..].join(" / "),
    };
    let location = key.and_then(|i| {
        lines[i..]
            .iter()
            .filter_map(|l| l.strip_prefix("at "))
            // Relative (`./crates/…`) or absolute (`/home/…/crates/…`), as the build left it.
            .filter_map(|l| l.find("crates/").map(|at| &l[at..]))
            .find(|l| !l.starts_with("crates/kvq-fuzz/"))
            .map(str::to_string)
    });
    let message = if words.is_empty() {
        format!("the process died ({status})")
    } else {
        format!("the process died ({status}): {words}")
    };
    (message, location)
}

/// Runs the loop in child processes of `exe` (this program, with `--child`), restarting after an
/// abort or a hang until the time is spent; an abort's input (from the marker file) is a finding.
pub fn supervise(cfg: &Config, exe: &Path) -> std::io::Result<Report> {
    let started = Instant::now();
    fs::create_dir_all(&cfg.findings)?;
    let session = session_path(&cfg.findings, cfg.target);
    let _ = fs::remove_file(&session);
    let marker = marker_path(&cfg.findings, cfg.target);
    let mut report = Report {
        next: cfg.start,
        ..Default::default()
    };
    let mut seen: HashSet<String> = HashSet::new();
    loop {
        let left = cfg.seconds - started.elapsed().as_secs_f64();
        let inputs_left = cfg.max_inputs.map(|m| m.saturating_sub(report.executed));
        if left <= 0.0 || inputs_left == Some(0) {
            break;
        }
        let _ = fs::remove_file(&marker);
        let mut cmd = Command::new(exe);
        // A backtrace on an abort gives the finding its location in kvq's code.
        cmd.env("RUST_BACKTRACE", "1")
            .arg(cfg.target.name())
            .arg("--child")
            .args(["--seconds", &format!("{left:.3}")])
            .args(["--seed", &cfg.seed.to_string()])
            .args(["--start", &report.next.to_string()])
            .args(["--limit", &format!("{:.3}", cfg.limit.as_secs_f64())])
            .args(["--stack", &cfg.stack.to_string()])
            .args(["--max-alloc", &cfg.max_alloc.to_string()])
            .arg("--findings")
            .arg(&cfg.findings);
        if let Some(n) = inputs_left {
            cmd.args(["--max-inputs", &n.to_string()]);
        }
        if !cfg.minimize {
            cmd.arg("--no-minimize");
        }
        let out = cmd.output()?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let mut done = None;
        for line in stdout.lines() {
            let fields: Vec<&str> = line.split('\t').collect();
            match fields.as_slice() {
                ["KVQ_FUZZ_DONE", executed, accepted, repeats, next, hung] => {
                    report.accepted += accepted.parse::<u64>().unwrap_or(0);
                    done = Some((
                        executed.parse::<u64>().unwrap_or(0),
                        repeats.parse::<u64>().unwrap_or(0),
                        next.parse::<u64>().unwrap_or(report.next),
                        *hung == "1",
                    ));
                }
                ["KVQ_FUZZ_FINDING", kind, file, signature]
                    if seen.insert(signature.to_string()) =>
                {
                    let input = fs::read(file).unwrap_or_default();
                    let kind = match *kind {
                        "panic" => Kind::Panic,
                        "hang" => Kind::Hang,
                        "oracle" => Kind::Oracle,
                        _ => Kind::Abort,
                    };
                    let txt = Path::new(file).with_extension("txt");
                    let text = fs::read_to_string(&txt).unwrap_or_default();
                    let field = |name: &str| {
                        text.lines()
                            .find_map(|l| l.strip_prefix(name).map(str::to_string))
                    };
                    report.findings.push(Recorded {
                        finding: Finding {
                            kind,
                            message: field("message: ").unwrap_or_default(),
                            location: field("location: ").filter(|l| l != "-"),
                        },
                        signature: signature.to_string(),
                        input,
                        file: PathBuf::from(file),
                    });
                }
                _ => {}
            }
        }
        // The child's findings, as it printed them.
        eprint!("{stderr}");
        match done {
            Some((executed, repeats, next, hung)) => {
                report.executed += executed;
                report.repeats += repeats;
                report.next = next;
                if !hung {
                    break;
                }
            }
            None => {
                // Died: the marker holds the input it was running.
                let bytes = fs::read(&marker).unwrap_or_default();
                if bytes.len() < MARKER_HEAD {
                    return Err(std::io::Error::other(format!(
                        "the fuzz child died before its first input: {}",
                        death(&stderr, &out.status).0
                    )));
                }
                let word = |k: usize| {
                    u64::from_le_bytes(bytes[8 * k..8 * k + 8].try_into().unwrap_or([0; 8]))
                };
                let index = word(0);
                // What the child counted before it died.
                report.accepted += word(1);
                report.repeats += word(2);
                let input = bytes[MARKER_HEAD..].to_vec();
                let (message, location) = death(&stderr, &out.status);
                let finding = Finding {
                    kind: Kind::Abort,
                    message,
                    location,
                };
                let signature = finding.signature();
                report.executed += index + 1 - report.next.min(index + 1);
                report.next = index + 1;
                if seen.insert(signature.clone()) {
                    let r = record(cfg, finding, signature, input);
                    remember(&session, &r.signature);
                    report.findings.push(r);
                } else {
                    report.repeats += 1;
                }
            }
        }
    }
    let _ = fs::remove_file(&marker);
    let _ = fs::remove_file(&session);
    report.elapsed = started.elapsed();
    Ok(report)
}

/// The child's last words to its supervisor (stdout, tab-separated).
pub fn print_child_report(report: &Report) {
    println!(
        "KVQ_FUZZ_DONE\t{}\t{}\t{}\t{}\t{}",
        report.executed,
        report.accepted,
        report.repeats,
        report.next,
        u8::from(report.hung)
    );
}

/// Runs one saved input (a finding's `.input` file) and says what it gives.
pub fn replay(target: Target, input: &[u8], stack: usize, limit: Duration) -> Result<(), Finding> {
    let mut exec = Executor::new(stack, limit);
    exec.run(target.check(), input)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn a_death_names_the_runtime_words_and_kvq_frame() {
        let stderr = "\n=== finding (scheme): panic: attempt to multiply with overflow\n\
            memory allocation of 4294967296 bytes failed\nstack backtrace:\n\
            0: std::alloc::rust_oom\n at /rustc/x/library/std/src/alloc.rs:424:5\n\
            9: kvq_reference::int::store::TensorStore::build_int\n\
            at ./crates/kvq-reference/src/int/store.rs:153:26\n\
            13: kvq_fuzz::scheme::check_at\n at ./crates/kvq-fuzz/src/scheme.rs:349:25\n";
        let (message, location) = death(stderr, &std::process::ExitStatus::from_raw(6));
        assert!(
            message.contains("memory allocation of 4294967296 bytes failed"),
            "{message}"
        );
        assert_eq!(
            location.as_deref(),
            Some("crates/kvq-reference/src/int/store.rs:153:26")
        );
        let (message, location) = death(
            "thread 'kvq-fuzz-worker' has overflowed its stack\nfatal runtime error: stack overflow, aborting\n",
            &std::process::ExitStatus::from_raw(6),
        );
        assert!(message.contains("has overflowed its stack"), "{message}");
        assert_eq!(location, None);
    }
}
