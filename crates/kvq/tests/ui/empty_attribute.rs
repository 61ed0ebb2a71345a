#[kvq::scheme]
struct Bare;

#[kvq::scheme()]
struct Empty;

fn main() {}
