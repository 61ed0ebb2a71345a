//! Compile-fail tests of `#[kvq::scheme]`: every class of invalid scheme is a compile error on the
//! offending tokens. The expected errors are the checked-in `tests/ui/*.stderr` files; regenerate
//! them with `TRYBUILD=overwrite cargo test -p kvq --test ui` and review the diff.

#[test]
fn invalid_schemes_fail_to_compile() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}
