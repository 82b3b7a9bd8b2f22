//! The class-free core stays class-free: the rules `docs/contract.md` states, checked over
//! `cargo metadata` (declared dependencies) and the sources (imports).
//!
//! A class is a package under `crates/classes/`. The rules:
//! - the server core (`outboard-server`) depends on no class and names none;
//! - the session protocol (`outboard-session`) depends on no class and names none;
//! - the client core (`outboard-client`: the session channel, resume, open-by-name, the
//!   manager's API) depends on no class and names none — so open-by-name returns whatever
//!   handle the class asked for builds, never a class's client of its own choosing;
//! - the manager depends on no class and names none of a class's types.

use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("the workspace root")
        .to_path_buf()
}

/// Every package of the workspace: (name, manifest directory, names of its dependencies).
fn packages() -> Vec<(String, PathBuf, Vec<String>)> {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(workspace())
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata is JSON");
    meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| {
            let dir = Path::new(p["manifest_path"].as_str().expect("manifest path"))
                .parent()
                .expect("a directory")
                .to_path_buf();
            let deps = p["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                // Tests may use a class to exercise the core; the rules are about what ships.
                .filter(|d| d["kind"].is_null())
                .map(|d| d["name"].as_str().expect("a name").to_string())
                .collect();
            (p["name"].as_str().expect("a name").to_string(), dir, deps)
        })
        .collect()
}

/// The class packages: everything under `crates/classes/`.
fn classes(all: &[(String, PathBuf, Vec<String>)]) -> Vec<String> {
    let root = workspace().join("crates/classes");
    let found: Vec<String> = all
        .iter()
        .filter(|(_, dir, _)| dir.starts_with(&root))
        .map(|(name, _, _)| name.clone())
        .collect();
    assert!(!found.is_empty(), "no class packages under {root:?}");
    found
}

/// Rust files under `dir` (or `dir` itself).
fn sources(dir: &Path) -> Vec<PathBuf> {
    if dir.is_file() {
        return vec![dir.to_path_buf()];
    }
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).expect("readable") {
        let p = e.expect("an entry").path();
        if p.is_dir() {
            out.extend(sources(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out
}

/// Where `path`'s sources name one of `classes` (as a Rust path: `outboard_block::…`).
fn mentions(path: &Path, classes: &[String]) -> Vec<String> {
    let mut found = Vec::new();
    for f in sources(path) {
        let text = std::fs::read_to_string(&f).expect("readable");
        for c in classes {
            let ident = c.replace('-', "_");
            for (n, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                if code.contains(&format!("{ident}::")) || code.contains(&format!("{ident};")) {
                    found.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
                }
            }
        }
    }
    found
}

/// The driver crate's modules (its chip drivers and their class bindings): a class-free
/// package may use the catalog at the crate's root (`by_name`, `probe_driver`, `Personality`),
/// never a driver, which would bring its class in by the back door.
fn driver_modules() -> Vec<String> {
    let dir = workspace().join("crates/drivers/src");
    let found: Vec<String> = std::fs::read_dir(&dir)
        .expect("readable")
        .map(|e| e.expect("an entry").path())
        .filter_map(|p| {
            let stem = p.file_stem()?.to_str()?.to_string();
            (stem != "lib" && (p.is_dir() || p.extension().is_some_and(|x| x == "rs")))
                .then(|| format!("outboard_drivers::{stem}"))
        })
        .collect();
    assert!(found.len() >= 3, "drivers' modules: {found:?}");
    found
}

fn assert_class_free(package: &str, src: &Path) {
    let all = packages();
    let classes = classes(&all);
    let (_, _, deps) = all
        .iter()
        .find(|(n, _, _)| n == package)
        .unwrap_or_else(|| panic!("no package {package}"));
    let bad: Vec<&String> = deps.iter().filter(|d| classes.contains(d)).collect();
    assert!(bad.is_empty(), "{package} depends on the classes {bad:?}");
    let named = mentions(src, &classes);
    assert!(
        named.is_empty(),
        "{package} names a class:\n{}",
        named.join("\n")
    );
    let drivers: Vec<String> = driver_modules()
        .into_iter()
        .filter(|m| m != "outboard_drivers::personality")
        .collect();
    let named = mentions(src, &drivers);
    assert!(
        named.is_empty(),
        "{package} names a driver (and so its class):\n{}",
        named.join("\n")
    );
}

#[test]
fn the_server_core_knows_no_class() {
    assert_class_free("outboard-server", &workspace().join("crates/server/src"));
}

#[test]
fn the_session_protocol_knows_no_class() {
    assert_class_free("outboard-session", &workspace().join("crates/session/src"));
}

#[test]
fn the_client_core_channel_and_open_by_name_know_no_class() {
    assert_class_free("outboard-client", &workspace().join("crates/client/src"));
}

#[test]
fn the_manager_knows_no_class() {
    assert_class_free("outboard-manager", &workspace().join("crates/manager/src"));
}

#[test]
fn the_check_sees_a_class_where_one_is_named() {
    // The rule would pass vacuously if it could not see a class: the block class's own
    // dispatcher names it.
    let classes = classes(&packages());
    let dispatcher = workspace().join("crates/classes/block/server/src/dispatcher.rs");
    assert!(!mentions(&dispatcher, &classes).is_empty());
    // Nor if it could not see a driver named: the CLI's bring-up tools name one.
    let hw = workspace().join("crates/cli/src/hw.rs");
    assert!(!mentions(&hw, &driver_modules()).is_empty());
}
