//! Rebuilds the crate when a migration is added, changed or removed: `sqlx::migrate!`
//! embeds `migrations/` at compile time, and on stable Rust it cannot tell cargo to
//! watch that directory itself.

fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
