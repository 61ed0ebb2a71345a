//! Projection files (`kvq-projections-1`): a layer's XQuant projections saved as safetensors load
//! back bit for bit, and every file that is not projections for the caller's scheme and shape is a
//! typed error whose message names the problem.

use kvq_reference::synth::{generate, SynthConfig};
use kvq_reference::xquant::{ProjectionFileError, Projections, PROJECTION_FILE_FORMAT};
use kvq_spec::SchemeSpec;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;

const XQ: &str = "k = int(2, channel), v = int(2, token), source = x(latent)";
const XQ_CL: &str = "k = int(2, channel), v = int(2, token), source = x(cross_layer)";

fn spec(text: &str) -> SchemeSpec {
    text.parse().unwrap()
}

/// `d_model` 96 against 2 heads × 64: rank 96 (a multiple of 32, so no padding); 160 pads none
/// either side of 128 (rank 128).
fn projections(d_model: usize) -> Projections {
    let s = generate(&SynthConfig {
        tokens: 8,
        kv_heads: 2,
        gqa: 2,
        head_dim: 64,
        d_model,
        seed: 9,
        ..Default::default()
    });
    Projections::from_weights(&s.layer.w_k, &s.layer.w_v, d_model, 2, 64).unwrap()
}

/// A tensor as the test rewrites it: name, dtype, shape, bytes.
type Tensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// The file's tensors and metadata, to rewrite one of them.
fn parts(bytes: &[u8]) -> (Vec<Tensor>, HashMap<String, String>) {
    let t = SafeTensors::deserialize(bytes).unwrap();
    let (_, meta) = SafeTensors::read_metadata(bytes).unwrap();
    let tensors = t
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    (tensors, meta.metadata().clone().unwrap())
}

fn rebuild(tensors: &[Tensor], meta: HashMap<String, String>) -> Vec<u8> {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize(views, &Some(meta)).unwrap()
}

fn load(bytes: &[u8], text: &str, d_model: usize) -> Result<Projections, ProjectionFileError> {
    Projections::from_safetensors(bytes, &spec(text), d_model, 2, 64)
}

#[test]
fn projections_round_trip_bit_for_bit_through_bytes_and_files() {
    for d_model in [96, 160] {
        let p = projections(d_model);
        let bytes = p.to_safetensors(&spec(XQ)).unwrap();
        assert_eq!(load(&bytes, XQ, d_model).unwrap(), p);
        // Bits and pages do not shape a projection.
        assert_eq!(
            load(
                &bytes,
                "k = int(4, channel), v = int(3, token), page = 64, source = x(latent)",
                d_model
            )
            .unwrap(),
            p
        );
        let dir = std::env::temp_dir().join(format!("kvq-xq-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("layer{d_model}.safetensors"));
        p.save(&path, &spec(XQ_CL)).unwrap();
        assert_eq!(
            Projections::load(&path, &spec(XQ_CL), d_model, 2, 64).unwrap(),
            p
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn files_for_something_else_are_typed_errors() {
    let p = projections(96);
    let bytes = p.to_safetensors(&spec(XQ)).unwrap();
    let err = |r: Result<Projections, ProjectionFileError>| r.unwrap_err();

    assert!(matches!(
        err(load(&bytes, "k = int(2, channel), v = int(2, token)", 96)),
        ProjectionFileError::NotXQuant(_)
    ));
    assert!(matches!(
        p.to_safetensors(&spec("k = int(2, channel), v = int(2, token)")),
        Err(ProjectionFileError::NotXQuant(_))
    ));
    let e = err(load(&bytes, XQ_CL, 96));
    assert!(
        matches!(e, ProjectionFileError::SourceMismatch { .. }),
        "{e}"
    );
    let e = err(load(&bytes, XQ, 128));
    assert!(
        matches!(
            e,
            ProjectionFileError::ShapeMismatch {
                what: "d_model",
                expected: 128,
                found: 96
            }
        ),
        "{e}"
    );
    let e = err(Projections::from_safetensors(&bytes, &spec(XQ), 96, 2, 32));
    assert!(e.to_string().contains("head_dim"), "{e}");
    let e = err(load(b"not a file", XQ, 96));
    assert!(matches!(e, ProjectionFileError::NotSafetensors(_)), "{e}");

    let (tensors, meta) = parts(&bytes);
    let mut m = meta.clone();
    m.insert("kvq.format".into(), "kvq-projections-9".into());
    let e = err(load(&rebuild(&tensors, m), XQ, 96));
    assert!(
        matches!(e, ProjectionFileError::UnknownFormat { .. }),
        "{e}"
    );
    assert!(e.to_string().contains(PROJECTION_FILE_FORMAT), "{e}");
    let mut m = meta.clone();
    m.remove("kvq.rank");
    let e = err(load(&rebuild(&tensors, m), XQ, 96));
    assert!(
        matches!(e, ProjectionFileError::MissingMetadata { key: "kvq.rank" }),
        "{e}"
    );
    let mut m = meta.clone();
    m.insert("kvq.kv_heads".into(), "two".into());
    let e = err(load(&rebuild(&tensors, m), XQ, 96));
    assert!(matches!(e, ProjectionFileError::BadMetadata { .. }), "{e}");

    // A tensor missing, one too many, one of another dtype.
    let fewer: Vec<_> = tensors.iter().filter(|t| t.0 != "v.up").cloned().collect();
    let e = err(load(&rebuild(&fewer, meta.clone()), XQ, 96));
    assert!(e.to_string().contains("`v.up` is missing"), "{e}");
    let mut more = tensors.clone();
    more.push(("k.extra".into(), Dtype::F32, vec![1], vec![0; 4]));
    let e = err(load(&rebuild(&more, meta.clone()), XQ, 96));
    assert!(e.to_string().contains("unexpected tensor `k.extra`"), "{e}");
    let mut f64s = tensors.clone();
    let down = f64s.iter_mut().find(|t| t.0 == "k.down").unwrap();
    down.1 = Dtype::F16;
    down.3.truncate(down.3.len() / 2);
    let e = err(load(&rebuild(&f64s, meta.clone()), XQ, 96));
    assert!(
        e.to_string().contains("`k.down` is F16, expected F32"),
        "{e}"
    );

    // A NaN is refused on the way in and on the way out.
    let mut nan = tensors.clone();
    let up = nan.iter_mut().find(|t| t.0 == "k.up").unwrap();
    up.3[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
    let e = err(load(&rebuild(&nan, meta), XQ, 96));
    assert!(
        matches!(e, ProjectionFileError::NonFinite { ref tensor, index: 2, .. } if tensor == "k.up"),
        "{e}"
    );
    let mut bad = p.clone();
    bad.v.down[5] = f32::INFINITY;
    assert!(matches!(
        bad.to_safetensors(&spec(XQ)),
        Err(ProjectionFileError::NonFinite { .. })
    ));
}
