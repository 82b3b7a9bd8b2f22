//! Exports the `osenv` calls and the native model's `outboard_dev_*` calls from the `outboard`
//! binary's dynamic symbol table, so that a C
//! driver loaded as a shared object (`driver-host --driver-lib`) resolves them against the
//! binary that loads it.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-link-arg-bins=-Wl,--export-dynamic-symbol=osenv_*");
    // The native model's device calls (include/outboard/native.h).
    println!("cargo:rustc-link-arg-bins=-Wl,--export-dynamic-symbol=outboard_dev_*");
}
