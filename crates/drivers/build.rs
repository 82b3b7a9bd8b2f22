//! Compiles the drivers written in C — against `include/outboard/osenv.h` (legacy drivers) or
//! `include/outboard/native.h` (native ones) —, each with its descriptor renamed so that
//! several can be linked into one binary.
fn main() {
    println!("cargo:rerun-if-changed=c");
    println!("cargo:rerun-if-changed=../../include/outboard");
    for (file, symbol) in [
        ("timer", "outboard_builtin_timer"),
        ("uart16550", "outboard_builtin_uart16550"),
        ("native_timer", "outboard_builtin_native_timer"),
        ("native_uart16550", "outboard_builtin_native_uart16550"),
    ] {
        cc::Build::new()
            .file(format!("c/{file}.c"))
            .define("OUTBOARD_DRIVER_SYMBOL", symbol)
            .include("../../include")
            .flag_if_supported("-std=c11")
            .warnings(true)
            .extra_warnings(true)
            .warnings_into_errors(true)
            .compile(&format!("outboard_legacy_{file}"));
    }
}
