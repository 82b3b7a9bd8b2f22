//! Compiles the C half of the interface: the variadic calls (`osenv_log`, `osenv_panic`),
//! which stable Rust cannot define, and the self-test driver the tests load.
fn main() {
    println!("cargo:rerun-if-changed=c");
    println!("cargo:rerun-if-changed=../../include/outboard/osenv.h");
    cc::Build::new()
        .file("c/varargs.c")
        .file("c/selftest.c")
        .include("../../include")
        .flag_if_supported("-std=c11")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .compile("outboard_osenv_c");
}
