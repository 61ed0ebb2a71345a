//! The C calls on a GPU: `kvq_merge` on memory and a stream the test owns, as an engine would call
//! it, gives the Rust launch's outputs bit for bit and the reference merge within its rounding.
//! Runs under kvq's harness: without a GPU it shows as ignored, with the reason
//! (`KVQ_REQUIRE_GPU=1` makes that a failure).

use std::ffi::{c_void, CStr};

use kvq::codegen::Dtype;
use kvq::reference::step::{merge, AttentionState};
use kvq::runtime::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use kvq::runtime::tune::synth::{random_queries, word_to_f32};
use kvq::runtime::{Device, Jit, MergeKernel};
use kvq_capi::*;
use kvq_runtime::testing::harness::{needs, run};
use kvq_runtime::testing::Need;

fn main() {
    run(vec![needs(
        Need::Gpu,
        "c_merge_equals_the_rust_launch_and_the_reference",
        c_merge_equals_the_rust_launch_and_the_reference,
    )])
}

fn ptr<T>(buf: &CudaSlice<T>, stream: &CudaStream) -> *mut c_void {
    let (p, _guard) = buf.device_ptr(stream);
    p as *mut c_void
}

fn c_merge_equals_the_rust_launch_and_the_reference() {
    let device = Device::open(0).expect("GPU");
    let jit = Jit::new(&device).expect("JIT");
    let stream = device.new_stream().expect("stream");
    let (parts, q_len, q_heads) = (3usize, 5usize, 8usize);
    let rows = q_len * q_heads;
    for (dtype, code) in [(Dtype::F16, KVQ_DTYPE_F16), (Dtype::Bf16, KVQ_DTYPE_BF16)] {
        for head_dim in [64u32, 128, 256] {
            let d = head_dim as usize;
            let limits = KvqPlanLimits {
                head_dim,
                q_heads: q_heads as u32,
                kv_heads: 2,
                dtype: code,
                max_seqs: 2,
                max_seq_len: 4096,
                pool_pages: 64,
                max_q_len: 1,
                rope_theta: 0.0,
                d_model: 0,
            };
            let plan = KvqPlan::new("kivi2", &limits).expect("plan");
            let status = unsafe { kvq_plan_load(&plan, 0) };
            assert_eq!(status, KvqStatus::Ok, "{:?}", unsafe {
                CStr::from_ptr(kvq_last_error_message())
            });
            let (bits, vals) =
                random_queries(parts * rows * d, dtype, 7 + head_dim as u64).unwrap();
            let (_, raw) = random_queries(parts * rows, dtype, 11 + head_dim as u64).unwrap();
            let mut lses: Vec<f32> = raw.iter().map(|x| 6.0 * x).collect();
            lses[rows + 3] = f32::NEG_INFINITY; // part 1 saw none of row 3's tokens
            for p in 0..parts {
                lses[p * rows + 7] = f32::NEG_INFINITY; // no part saw row 7's
            }
            let out_parts = stream.clone_htod(&bits).unwrap();
            let lse_parts = stream.clone_htod(&lses).unwrap();
            let c_out = stream.clone_htod(&vec![0xFFFFu16; rows * d]).unwrap();
            let c_lse = stream.clone_htod(&vec![f32::NAN; rows]).unwrap();
            let status = unsafe {
                kvq_merge(
                    &plan,
                    stream.cu_stream() as *mut c_void,
                    ptr(&out_parts, &stream),
                    ptr(&lse_parts, &stream).cast(),
                    parts as u32,
                    rows as u32,
                    ptr(&c_out, &stream),
                    ptr(&c_lse, &stream).cast(),
                )
            };
            assert_eq!(status, KvqStatus::Ok, "{:?}", unsafe {
                CStr::from_ptr(kvq_last_error_message())
            });
            let mut rust_out = stream.clone_htod(&vec![0xFFFFu16; rows * d]).unwrap();
            let mut rust_lse = stream.clone_htod(&vec![f32::NAN; rows]).unwrap();
            MergeKernel::load(&jit, head_dim, dtype)
                .unwrap()
                .merge(
                    &stream,
                    parts,
                    &out_parts,
                    &lse_parts,
                    &mut rust_out,
                    Some(&mut rust_lse),
                )
                .unwrap();
            let c_bits: Vec<u16> = stream.clone_dtoh(&c_out).unwrap();
            let c_lses: Vec<f32> = stream.clone_dtoh(&c_lse).unwrap();
            let rust_bits: Vec<u16> = stream.clone_dtoh(&rust_out).unwrap();
            let rust_lses: Vec<f32> = stream.clone_dtoh(&rust_lse).unwrap();
            let what = format!("d{head_dim} {dtype}");
            assert_eq!(c_bits, rust_bits, "{what}: C and Rust outputs differ");
            assert_eq!(
                c_lses.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                rust_lses.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{what}: C and Rust LSEs differ"
            );
            let states: Vec<AttentionState> = (0..parts)
                .map(|p| AttentionState {
                    out: vals[p * rows * d..(p + 1) * rows * d].to_vec(),
                    lse: lses[p * rows..(p + 1) * rows].to_vec(),
                    q_len,
                    q_heads,
                    head_dim: d,
                })
                .collect();
            let want = merge(&states).unwrap();
            let u = if dtype == Dtype::F16 {
                2f64.powi(-11)
            } else {
                2f64.powi(-8)
            };
            for (i, (&have, &w)) in c_bits.iter().zip(&want.out).enumerate() {
                let h = f64::from(word_to_f32(have, dtype));
                let bound = u * f64::from(w.abs()) + 1e-6;
                assert!(
                    (h - f64::from(w)).abs() <= bound,
                    "{what}: element {i}: {h} for {w}"
                );
            }
            for (r, (&h, &w)) in c_lses.iter().zip(&want.lse).enumerate() {
                assert!(
                    h == w
                        || (f64::from(h) - f64::from(w)).abs() <= 1e-5 * (1.0 + f64::from(w).abs()),
                    "{what}: row {r}: LSE {h} for {w}"
                );
            }
            assert_eq!(c_lses[7], f32::NEG_INFINITY, "{what}: a row no part saw");
        }
    }
}
