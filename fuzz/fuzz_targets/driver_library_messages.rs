#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| outboard_fuzz_targets::driver_library_messages(data));
