//! What a decode step's calls cost on the host, from Rust: the runtime's launches themselves
//! (`CacheWriter::append_raw`, `DecodeKernel::attend_raw`, on a stream borrowed once) and the
//! same step through the C ABI (`kvq_append`, `kvq_attend`, which find the stream's GPU, the
//! plan's kernels and the workspace's layout on every call). Also the step's GPU time when the
//! host keeps ahead of the GPU (a run of steps launched back to back). The Python example
//! `examples/python/graph_decode.py` measures the Python calls on the same problem; together they
//! give the Python package's host cost over the Rust launch (docs/BENCHMARKS.md, "Engine calls").
//!
//! `cargo run --release -p kvq-capi --example step_host_time -- [scheme] [batch] [prompt]
//! [head_dim]` (defaults: kivi2 8 4000 128; needs a GPU).

use std::error::Error;
use std::ffi::{c_void, CStr};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use kvq::codegen::Dtype;
use kvq::runtime::cudarc::driver::sys::CUevent_flags;
use kvq::runtime::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use kvq::runtime::tune::synth::random_queries;
use kvq::runtime::CachePtrs;
use kvq_capi::*;

const Q_HEADS: u32 = 32;
const KV_HEADS: u32 = 8;
const STEPS: usize = 200;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn check(status: KvqStatus) -> Result<(), Box<dyn Error>> {
    if status == KvqStatus::Ok {
        return Ok(());
    }
    // SAFETY: the message is the calling thread's NUL-terminated string.
    let msg = unsafe { CStr::from_ptr(kvq_last_error_message()) };
    Err(format!("{status:?}: {}", msg.to_string_lossy()).into())
}

fn arg<T: std::str::FromStr>(i: usize, default: T) -> Result<T, Box<dyn Error>> {
    match std::env::args().nth(i) {
        Some(s) => s.parse().map_err(|_| format!("argument {i}: {s:?}").into()),
        None => Ok(default),
    }
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn run() -> Result<(), Box<dyn Error>> {
    let scheme: String = arg(1, "kivi2".to_string())?;
    let batch: u32 = arg(2, 8)?;
    let prompt: u32 = arg(3, 4000)?;
    let head_dim: u32 = arg(4, 128)?;
    let mut limits = KvqPlanLimits {
        head_dim,
        q_heads: Q_HEADS,
        kv_heads: KV_HEADS,
        dtype: KVQ_DTYPE_F16,
        max_seqs: batch,
        // Room for the prompt and every step below (each of the three loops appends a token).
        max_seq_len: prompt + 4 * STEPS as u32,
        pool_pages: 1,
        max_q_len: 1,
        rope_theta: 0.0,
        d_model: 0,
    };
    limits.pool_pages = batch * KvqPlan::new(&scheme, &limits)?.info().max_pages_per_seq;
    let plan = KvqPlan::new(&scheme, &limits)?;
    let gpu = gpu(0)?;
    let kernels = plan_kernels(&gpu, &plan)?;
    let stream = gpu.device.new_stream()?;
    let raw_stream = stream.cu_stream() as *mut c_void;

    // The engine's memory: the plan's buffers, a block table naming pool pages in order, the
    // workspace, the step's tensors.
    let buffers: Vec<CudaSlice<u8>> = (0..plan.buffer_count())
        .map(|i| stream.alloc_zeros::<u8>((plan.buffer(i).unwrap().bytes as usize).max(1)))
        .collect::<Result<_, _>>()?;
    let mut buffers = buffers;
    let table: Vec<u8> = (0..limits.pool_pages as i32)
        .flat_map(i32::to_le_bytes)
        .collect();
    stream.memcpy_htod(&table, &mut buffers[7])?;
    let p: Vec<u64> = buffers.iter().map(|b| addr(b, &stream)).collect();
    let c = |i: usize| p[i] as *mut c_void;
    let cache = KvqCache {
        k_pool: c(0),
        v_pool: c(1),
        k_sink: c(2),
        v_sink: c(3),
        k_tail: c(4),
        v_tail: c(5),
        seq_lens: c(6),
        page_table: c(7),
        k_pending: c(8),
        v_pending: c(9),
        status: c(10),
        codebooks: c(11),
        xquant_weights: c(12),
        xquant_accumulator: c(13),
    };
    let ptrs = CachePtrs {
        kv_heads: KV_HEADS as usize,
        head_dim: head_dim as usize,
        max_pages: plan.sizes().max_pages,
        k_pool: p[0],
        v_pool: p[1],
        page_table: p[7],
        k_sink: p[2],
        v_sink: p[3],
        k_tail: p[4],
        v_tail: p[5],
        seq_lens: p[6],
    };
    let workspace = stream.alloc_zeros::<u8>(kernels.workspace_bytes)?;
    let ws = workspace.device_ptr(&stream).0;
    let (n, kv_row, q_row) = (
        batch as usize,
        (KV_HEADS * head_dim) as usize,
        (Q_HEADS * head_dim) as usize,
    );
    let upload = |words: usize, seed: u64| -> Result<CudaSlice<u16>, Box<dyn Error>> {
        let (w, _) = random_queries(words, Dtype::F16, seed)?;
        Ok(stream.clone_htod(&w)?)
    };
    let k = upload(n * prompt as usize * kv_row, 1)?;
    let v = upload(n * prompt as usize * kv_row, 2)?;
    let (k_new, v_new, q) = (
        upload(n * kv_row, 3)?,
        upload(n * kv_row, 4)?,
        upload(n * q_row, 5)?,
    );
    let out = stream.alloc_zeros::<u16>(n * q_row)?;
    let lse = stream.alloc_zeros::<f32>(n * Q_HEADS as usize)?;
    let slot_list: Vec<i32> = (0..batch as i32).collect();
    let slots = stream.clone_htod(&slot_list)?;
    let tokens = vec![prompt; n];
    let (kp, vp, knp, vnp, qp) = (
        addr(&k, &stream),
        addr(&v, &stream),
        addr(&k_new, &stream),
        addr(&v_new, &stream),
        addr(&q, &stream),
    );
    let (op, lp, sp) = (
        addr(&out, &stream),
        addr(&lse, &stream),
        addr(&slots, &stream),
    );
    // SAFETY: every pointer is this program's device memory of the plan's sizes, alive to the end.
    check(unsafe {
        kvq_prefill(
            &plan,
            &cache,
            raw_stream,
            batch,
            slot_list.as_ptr(),
            tokens.as_ptr(),
            kp as *const c_void,
            vp as *const c_void,
            ws as *mut c_void,
        )
    })?;
    stream.synchronize()?;

    // SAFETY (every closure): as above; the launches stay within the plan's limits.
    let rust_append = || unsafe {
        kernels
            .writer
            .append_raw(&stream, &ptrs, n, 1, sp, knp, vnp)
    };
    let rust_attend = || -> Result<(), Box<dyn Error>> {
        let mut scratch = unsafe { kernels.scratch(&plan, n, ws) }?;
        unsafe {
            kernels
                .decode
                .attend_raw(&stream, &ptrs, n, 1, sp, qp, op, lp, &mut scratch)
        }?;
        Ok(())
    };
    let c_append = || unsafe {
        kvq_append(
            &plan,
            &cache,
            raw_stream,
            batch,
            1,
            sp as *const i32,
            knp as *const c_void,
            vnp as *const c_void,
        )
    };
    let c_attend = || unsafe {
        kvq_attend(
            &plan,
            &cache,
            raw_stream,
            batch,
            1,
            sp as *const i32,
            qp as *const c_void,
            op as *mut c_void,
            lp as *mut f32,
            ws as *mut c_void,
        )
    };

    // Host time of each call, the GPU idle before it (as in the Python example).
    let mut times: [Vec<f64>; 4] = Default::default();
    for _ in 0..STEPS {
        stream.synchronize()?;
        let t = Instant::now();
        rust_append()?;
        times[0].push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        rust_attend()?;
        times[1].push(t.elapsed().as_secs_f64() * 1e6);
        stream.synchronize()?;
        let t = Instant::now();
        check(c_append())?;
        times[2].push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        check(c_attend())?;
        times[3].push(t.elapsed().as_secs_f64() * 1e6);
    }
    // GPU time of a step when launches queue ahead of the GPU: a run of steps between two events.
    stream.synchronize()?;
    let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    for _ in 0..STEPS {
        rust_append()?;
        rust_attend()?;
    }
    let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    end.synchronize()?;
    let gpu_step = f64::from(start.elapsed_ms(&end)?) * 1e3 / STEPS as f64;

    println!(
        "{scheme}, batch {batch}, {prompt} + {} tokens, head_dim {head_dim}, {Q_HEADS} q / \
         {KV_HEADS} KV heads: host time of a call (median of {STEPS})",
        3 * STEPS
    );
    let names = [
        "Rust append_raw",
        "Rust attend_raw",
        "C kvq_append",
        "C kvq_attend",
    ];
    let med: Vec<f64> = times.iter_mut().map(|xs| median(xs)).collect();
    for (name, m) in names.iter().zip(&med) {
        println!("  {name}: {m:.1} µs");
    }
    println!(
        "  a step (append + attend): Rust {:.1} µs, C {:.1} µs",
        med[0] + med[1],
        med[2] + med[3]
    );
    println!("  GPU time of a step, launched back to back: {gpu_step:.1} µs");
    Ok(())
}

/// A device buffer's address (cudarc's access guard is dropped at once: this program's one
/// stream orders every use of its buffers).
fn addr<T>(buffer: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    buffer.device_ptr(stream).0
}
