// The scheme is the type: a struct with fields would carry state the scheme cannot describe.
#[kvq::scheme(k = int(2, channel), v = int(2, token))]
struct WithFields {
    bits: u8,
}

#[kvq::scheme(k = int(2, channel), v = int(2, token))]
struct Tuple(u8);

fn main() {}
