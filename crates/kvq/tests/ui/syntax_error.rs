// A missing comma between items, and a character the grammar does not know.
#[kvq::scheme(k = int(2, channel) v = int(2, token))]
struct NoComma;

#[kvq::scheme(k = int(2, channel); v = int(2, token))]
struct Semicolon;

fn main() {}
