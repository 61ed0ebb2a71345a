//! CommVQ: RoPE-commutative additive codebooks for keys, binary additive codebooks for values.
