// A key given twice is an error on the second one, not "last one wins".
#[kvq::scheme(k = int(2, channel), v = int(2, token), local = 128, local = 64)]
struct Twice;

fn main() {}
