//! Codebook schemes (CommVQ): the decode unit ([`decode`]) and the cache-filling unit ([`encode`]),
//! thin translation units over `kernels/include/kvq/codebook/`, sharing their side traits
//! ([`sides`]).

mod decode;
mod encode;
mod sides;

pub use decode::{
    codebook_candidates, codebook_kernels, codebook_kernels_with, has_codebook_kernel,
    CodebookKernels, CodebookParams, CODEBOOK_SMEM_THREADS, CODEBOOK_SMEM_TILE, CODEBOOK_THREADS,
    CODEBOOK_TILE,
};
pub use encode::{
    codebook_encode_kernels, CodebookEncodeKernels, CodebookStepKernels, CODEBOOK_STATUS_WORDS,
    ENCODE_TOKENS, ENCODE_WARPS, STORE_THREADS,
};
