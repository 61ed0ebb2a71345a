#[kvq::scheme(k = int(2, chanel), v = int(2, token))]
struct Misspelt;

fn main() {}
