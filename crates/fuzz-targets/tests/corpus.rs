//! Replays the kept fuzz corpus (`fuzz/corpus/<target>/`) through every target, on stable: what
//! the fuzzer once found stays fixed.

use std::path::PathBuf;

#[test]
fn the_kept_corpus_replays_without_a_failure() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    let mut total = 0;
    for (name, target) in outboard_fuzz_targets::TARGETS {
        let dir = root.join(name);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            panic!("{} is missing: every target keeps a corpus", dir.display());
        };
        let mut n = 0;
        for e in entries.flatten() {
            let data = std::fs::read(e.path()).unwrap();
            target(&data);
            n += 1;
        }
        assert!(n > 0, "{name}: empty corpus");
        total += n;
    }
    assert!(total >= outboard_fuzz_targets::TARGETS.len());
}
