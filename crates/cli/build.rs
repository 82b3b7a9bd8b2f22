//! Exports the `osenv` calls from the `outboard` binary's dynamic symbol table, so that a C
//! driver loaded as a shared object (`driver-host --driver-lib`) resolves them against the
//! binary that loads it.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-link-arg-bins=-Wl,--export-dynamic-symbol=osenv_*");
}
