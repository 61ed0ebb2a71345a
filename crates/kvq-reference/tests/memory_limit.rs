//! The process-wide memory bound (its own test binary: the bound is global). A scheme's fixed
//! buffers are allocated whole, as a device cache holds them, so a 2^20-token page asks for a
//! gigabyte for one token: past the bound that is a typed error naming the buffer, never an abort.

use kvq_reference::int::IntCache;
use kvq_reference::resources::{memory_limit, set_memory_limit};
use kvq_reference::{KvTensor, RefError};
use kvq_spec::SchemeSpec;

#[test]
fn buffers_past_the_bound_are_errors_naming_them() {
    let x = KvTensor::new(vec![0.5; 128], 1, 1, 128).unwrap();
    let huge_page: SchemeSpec = "k = fp16, v = int(4, channel), page = 1048576"
        .parse()
        .unwrap();
    let huge_tail: SchemeSpec = "k = int(8, channel), v = int(3, channel), local = 1048576"
        .parse()
        .unwrap();
    // Unbounded (24 GB here), the 256 MiB page of FP16 keys is taken.
    assert!(IntCache::build(&huge_page, &x, &x).is_ok());
    set_memory_limit(Some(64 << 20));
    assert_eq!(memory_limit(), Some(64 << 20));
    for (spec, buffer) in [
        (&huge_page, "FP16 page pool"),
        (&huge_tail, "FP16 tail ring"),
    ] {
        match IntCache::build(spec, &x, &x) {
            Err(RefError::Alloc(e)) => {
                let text = e.to_string();
                assert!(
                    text.contains(buffer) && text.contains("this process's limit"),
                    "{text}"
                );
            }
            other => panic!("{spec}: {other:?}"),
        }
    }
    set_memory_limit(None);
    assert!(IntCache::build(&huge_page, &x, &x).is_ok());
}
