//! Emits a `SchemeSpec` as a Rust constant expression with absolute `::kvq::` paths.

use kvq_spec::*;
use proc_macro2::TokenStream;
use quote::quote;

fn opt<T>(v: Option<T>, f: impl Fn(T) -> TokenStream) -> TokenStream {
    match v {
        Some(x) => {
            let inner = f(x);
            quote!(::core::option::Option::Some(#inner))
        }
        None => quote!(::core::option::Option::None),
    }
}

fn tensor(t: &TensorQuant) -> TokenStream {
    match t {
        TensorQuant::Fp16 => quote!(::kvq::TensorQuant::Fp16),
        TensorQuant::Int(q) => {
            let bits = q.bits;
            let axis = match q.axis {
                Axis::Channel => quote!(::kvq::Axis::Channel),
                Axis::Token => quote!(::kvq::Axis::Token),
            };
            let group = opt(q.group, |g| quote!(#g));
            let symmetric = q.symmetric;
            let boost = opt(q.boost, |b| {
                let bits = b.bits;
                let ratio = b.ratio;
                let by = match b.by {
                    BoostCriterion::Magnitude => quote!(::kvq::BoostCriterion::Magnitude),
                    BoostCriterion::Variance => quote!(::kvq::BoostCriterion::Variance),
                };
                quote!(::kvq::Boost { bits: #bits, ratio: #ratio, by: #by })
            });
            let local = opt(q.local, |l| quote!(#l));
            quote!(::kvq::TensorQuant::Int(::kvq::IntQuant {
                bits: #bits, axis: #axis, group: #group, symmetric: #symmetric, boost: #boost, local: #local,
            }))
        }
        TensorQuant::Codebook(c) => {
            let codebook = match c.codebook {
                Codebook::RopeCommutative {
                    levels,
                    residuals,
                    pairs_per_code,
                } => quote!(::kvq::Codebook::RopeCommutative {
                    levels: #levels, residuals: #residuals, pairs_per_code: #pairs_per_code,
                }),
                Codebook::Additive { rows } => quote!(::kvq::Codebook::Additive { rows: #rows }),
            };
            let span = match c.span {
                CodebookSpan::Head => quote!(::kvq::CodebookSpan::Head),
                CodebookSpan::Token => quote!(::kvq::CodebookSpan::Token),
            };
            quote!(::kvq::TensorQuant::Codebook(::kvq::CodebookQuant { codebook: #codebook, span: #span }))
        }
    }
}

pub fn spec(s: &SchemeSpec) -> TokenStream {
    let k = tensor(&s.k);
    let v = tensor(&s.v);
    let page = s.page;
    let sink = s.sink;
    let local = s.local;
    let calibrate = opt(s.calibrate, |c| {
        let (t1, t2) = (c.tau1, c.tau2);
        quote!(::kvq::Calibration { tau1: #t1, tau2: #t2 })
    });
    let source = match s.source {
        CacheSource::Kv => quote!(::kvq::CacheSource::Kv),
        CacheSource::X(XSource::Latent) => quote!(::kvq::CacheSource::X(::kvq::XSource::Latent)),
        CacheSource::X(XSource::CrossLayer) => {
            quote!(::kvq::CacheSource::X(::kvq::XSource::CrossLayer))
        }
    };
    quote!(::kvq::SchemeSpec {
        k: #k, v: #v, page: #page, sink: #sink, local: #local, calibrate: #calibrate, source: #source,
    })
}
