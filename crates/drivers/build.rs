//! Compiles the drivers written in C against `include/outboard/osenv.h` (legacy drivers), each
//! with its descriptor renamed so that several can be linked into one binary.
fn main() {
    println!("cargo:rerun-if-changed=c");
    println!("cargo:rerun-if-changed=../../include/outboard");
    cc::Build::new()
        .file("c/timer.c")
        .define("OUTBOARD_DRIVER_SYMBOL", "outboard_builtin_timer")
        .include("../../include")
        .flag_if_supported("-std=c11")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .compile("outboard_legacy_drivers");
}
