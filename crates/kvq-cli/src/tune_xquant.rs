//! `kvq tune`'s rows for XQuant schemes (`source = x(latent)`, `x(cross_layer)`): the split count
//! of their decode at the library's default rebuild precision, stored or tuned now on synthetic
//! latents (`Tuner::tune_xquant`).

use kvq::codegen::RebuildPrecision;
use kvq::runtime::tune::{TuneProblem, Tuner};
use kvq::runtime::xquant::{xquant_choice, xquant_problem_key, XQuantKernel};

use crate::error::Result;
use crate::gpu::Gpu;
use crate::run::stored_cells;
use kvq_bench::grid::format_tokens;

/// The cells of `problem`'s row for a layer input of `d_model`: its stored split count (unless
/// `force`), or a tuning session now.
pub fn row(
    g: &Gpu,
    tuner: &mut Tuner<'_>,
    label: &str,
    problem: &TuneProblem,
    d_model: usize,
    force: bool,
) -> Result<Vec<String>> {
    let precision = RebuildPrecision::default();
    // Loaded (through the JIT's caches) for its key: the latent width and the rebuild's form.
    let kernel = XQuantKernel::load(
        &g.jit,
        &problem.spec,
        &problem.shape,
        problem.kv_heads,
        d_model,
        precision,
    )?;
    let key = xquant_problem_key(problem, kernel.generated());
    let stored = match force {
        true => None,
        false => tuner.store().lookup(tuner.gpu(), &key).cloned(),
    };
    if let Some(e) = stored {
        let launch = xquant_choice(&kernel, e.choice.splits).to_string();
        return Ok(stored_cells(&e, launch));
    }
    eprintln!(
        "[kvq tune] {label} batch {} context {} (d_model {d_model}, latents of {}, random latents)",
        problem.batch,
        format_tokens(problem.max_len),
        kernel.generated().rank
    );
    let r = tuner.tune_xquant(problem, d_model, precision)?;
    Ok(vec![
        "tuned".to_string(),
        xquant_choice(&kernel, r.chosen).to_string(),
        format!("{:.1}", r.default_us),
        format!("{:.1}", r.chosen_us),
        format!("{:.3}", r.speedup()),
        r.candidates.len().to_string(),
        r.rejected().to_string(),
        format!("{:.1}", r.elapsed.as_secs_f64()),
    ])
}
