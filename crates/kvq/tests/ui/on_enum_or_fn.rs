#[kvq::scheme(k = int(2, channel), v = int(2, token))]
enum Kivi {
    Two,
}

#[kvq::scheme(k = int(2, channel), v = int(2, token))]
fn kivi() {}

fn main() {}
