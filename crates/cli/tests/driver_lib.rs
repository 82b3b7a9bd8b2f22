//! A C driver built outside Outboard, as a driver's author would: the headers and pkg-config
//! file installed by `outboard sdk` (no Outboard source on the include path), the timer
//! driver (and the 16550's, legacy and native) compiled into a shared object, loaded by `[[driver]] library =`, matched by the
//! catalog over the built-in driver (its score is higher), serving its clock; a library of
//! another driver ABI version, and one that is no driver, refused with why.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{stdout, Up};
use rustix::process::Signal;

const EXE: &str = env!("CARGO_BIN_EXE_outboard");

/// Installs the SDK under `dir/sdk`; the `PKG_CONFIG_PATH` that finds it.
fn sdk(dir: &Path) -> PathBuf {
    let o = Command::new(EXE)
        .args(["sdk", "--prefix"])
        .arg(dir.join("sdk"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    dir.join("sdk/lib/pkgconfig")
}

/// Compiles `source` into `dir/out` as a shared object, with the SDK's flags and `defines`.
fn build(dir: &Path, source: &Path, out: &str, defines: &[&str]) -> PathBuf {
    let pc = sdk(dir);
    let cflags = Command::new("pkg-config")
        .args(["--cflags", "outboard-driver"])
        .env("PKG_CONFIG_PATH", &pc)
        .output()
        .unwrap();
    assert!(cflags.status.success(), "pkg-config: {cflags:?}");
    let cflags = String::from_utf8(cflags.stdout).unwrap();
    assert!(cflags.contains("/sdk/include"), "{cflags}");
    let lib = dir.join(out);
    let o = Command::new("cc")
        .args(["-shared", "-fPIC", "-std=c11", "-Wall", "-Werror", "-o"])
        .arg(&lib)
        .args(cflags.split_whitespace())
        .args(defines)
        .arg(source)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "cc: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    lib
}

fn timer_source() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../drivers/c/timer.c")
}

fn uart_source() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../drivers/c/uart16550.c")
}

fn driver_lib(lib: &Path) -> std::process::Output {
    Command::new(EXE)
        .arg("driver-lib")
        .arg(lib)
        .output()
        .unwrap()
}

#[test]
fn a_timer_driver_built_outside_the_tree_loads_matches_and_serves_its_clock() {
    let dir = tempfile::tempdir().unwrap();
    build(
        dir.path(),
        &timer_source(),
        "libmytimer.so",
        &["-DTIMER_DRIVER_NAME=\"my-timer\"", "-DTIMER_SCORE=2000"],
    );
    let o = driver_lib(&dir.path().join("libmytimer.so"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let said = stdout(&o);
    for want in [
        "my-timer",
        "driver ABI 1",
        "class  clock",
        "1234:0b71",
        "score  2000",
    ] {
        assert!(said.contains(want), "{want} in {said}");
    }

    serves_a_clock_across_a_kill(dir.path(), "libmytimer.so", "my-timer");
}

/// Runs a machine of one 500 Hz timer and driver library `lib` (in `dir`, named relative to
/// the description), whose driver `driver` must win the timer: it serves 50 ticks, and its
/// driver server, killed, comes back with the library loaded again and serves on.
fn serves_a_clock_across_a_kill(dir: &Path, lib: &str, driver: &str) {
    let machine = format!(
        "name = \"outside\"\n[[driver]]\nlibrary = \"{lib}\"\n\
         [[device]]\nname = \"clock0\"\nmodel = \"timer\"\nhz = 500\n"
    );
    let up = Up::start(dir, Some(&machine));
    let tree = common::registry(&up).to_string();
    assert!(
        tree.contains(&format!("\"kind\":\"driver\",\"name\":\"{driver}\"")),
        "the library's driver did not win: {tree}"
    );
    assert!(
        tree.contains(lib),
        "ls does not say where it came from: {tree}"
    );
    let o = up.run_within(
        &["clock", "clock0", "--ticks", "50"],
        Duration::from_secs(60),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = stdout(&o);
    assert!(
        out.contains("50 ticks in") && out.contains("says 500 Hz"),
        "{out}"
    );
    let up_pid = up.child.as_ref().unwrap().id();
    let servers = common::children_running(up_pid, "driver-host");
    assert_eq!(servers.len(), 1, "{servers:?}");
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", servers[0])).unwrap();
    assert!(String::from_utf8_lossy(&cmdline).contains("--driver-lib"));
    assert!(common::signal_child_of(up_pid, servers[0], Signal::KILL));
    let o = up.run_within(
        &["clock", "clock0", "--ticks", "10"],
        Duration::from_secs(60),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Builds `source` outside the tree as driver `name` (score 2000), checks what `outboard
/// driver-lib` reads from it (`said` among it), and writes through it to a line in a file.
fn serves_a_serial_line(source: &Path, name: &str, said: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let define = format!("-DUART_DRIVER_NAME=\"{name}\"");
    build(
        dir.path(),
        source,
        "libmyuart.so",
        &[&define, "-DUART_SCORE=2000"],
    );
    let o = driver_lib(&dir.path().join("libmyuart.so"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = stdout(&o);
    for want in [name, "class  char", "1b36:0002", "score  2000"]
        .iter()
        .chain(said)
    {
        assert!(out.contains(want), "{want} in {out}");
    }
    let machine = format!(
        r#"
name = "outside"

[[driver]]
library = "libmyuart.so"

[[device]]
name = "tty0"
model = "serial"
line = "file:{}/line.out"
"#,
        dir.path().display()
    );
    let up = Up::start(dir.path(), Some(&machine));
    let tree = common::registry(&up).to_string();
    assert!(
        tree.contains(&format!("\"kind\":\"driver\",\"name\":\"{name}\"")),
        "the library's driver did not win: {tree}"
    );
    let o = up.run_within(
        &["char", "write", "tty0", "from outside"],
        Duration::from_secs(60),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let file = dir.path().join("line.out");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::fs::read(&file).unwrap_or_default().len() < 12
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"from outside");
}

#[test]
fn a_16550_driver_built_outside_the_tree_serves_its_serial_line() {
    serves_a_serial_line(&uart_source(), "my-uart", &["model  legacy"]);
}

#[test]
fn a_native_16550_driver_built_outside_the_tree_serves_its_serial_line() {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../drivers/c/native_uart16550.c");
    serves_a_serial_line(&source, "my-native-uart", &["model  native"]);
}

#[test]
fn a_library_of_another_abi_version_or_no_driver_is_refused_with_why() {
    let dir = tempfile::tempdir().unwrap();
    let future = dir.path().join("future.c");
    std::fs::write(
        &future,
        r#"#include <stddef.h>
#include <outboard/driver.h>
static const struct outboard_pci_id ids[] = { { 0x1234, 0x0b71 }, { 0, 0 } };
static const int ops;
const struct outboard_driver outboard_driver = {
    .abi_version = 2,
    .size = sizeof(struct outboard_driver) + 8,
    .name = "future",
    .class_name = "clock",
    .ids = ids,
    .score = 5000,
    .class_ops = &ops,
};
"#,
    )
    .unwrap();
    let lib = build(dir.path(), &future, "libfuture.so", &[]);
    let o = driver_lib(&lib);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("driver ABI version 2") && e.contains("reads version 1"),
        "{e}"
    );

    let nothing = dir.path().join("nothing.c");
    std::fs::write(&nothing, "int not_a_driver(void) { return 1; }\n").unwrap();
    let lib = build(dir.path(), &nothing, "libnothing.so", &[]);
    let e = String::from_utf8_lossy(&driver_lib(&lib).stderr).to_string();
    assert!(e.contains("exports no `outboard_driver`"), "{e}");
    let e = String::from_utf8_lossy(&driver_lib(&dir.path().join("absent.so")).stderr).to_string();
    assert!(e.contains("cannot load"), "{e}");

    // `outboard up` refuses to start a machine with it, saying which and why.
    let machine = format!(
        "name = \"m\"\n[[driver]]\nlibrary = \"{}\"\n[[device]]\nname = \"clock0\"\nmodel = \"timer\"\n",
        dir.path().join("libfuture.so").display()
    );
    std::fs::write(dir.path().join("machine.toml"), machine).unwrap();
    let o = Command::new(EXE)
        .arg("up")
        .arg("--machine")
        .arg(dir.path().join("machine.toml"))
        .env("OUTBOARD_CONTROL", dir.path().join("rt/control.sock"))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("libfuture.so") && e.contains("driver ABI version 2"),
        "{e}"
    );
}

#[test]
fn a_crash_inside_a_c_driver_is_contained_to_its_server() {
    let dir = tempfile::tempdir().unwrap();
    // The timer driver, unchanged, wrapped by a driver whose tick sink dereferences NULL at
    // the 30th tick: a bug in C code, at interrupt level, on the interrupt thread.
    let crashy = dir.path().join("crashy.c");
    std::fs::write(
        &crashy,
        r#"#include <stddef.h>
#define OUTBOARD_DRIVER_SYMBOL timer_inner
#include "timer.c"
static const struct outboard_clock_sink *outer;
static void crash_or_forward(void *ctx, uint64_t total)
{
    (void)ctx;
    if (total >= 30) {
        volatile int *p = NULL;
        *p = 1;
    }
    outer->ticked(outer->ctx, total);
}
static const struct outboard_clock_sink mine = { NULL, crash_or_forward };
static int crashy_start(const struct outboard_clock_sink *s, uint32_t *hz)
{
    outer = s;
    return timer_ops.start(&mine, hz);
}
static const struct outboard_clock_ops crashy_ops = { crashy_start, timer_now };
const struct outboard_driver outboard_driver = {
    OUTBOARD_DRIVER_ABI, sizeof(struct outboard_driver), "crashy", OUTBOARD_CLASS_CLOCK,
    timer_ids, 3000, &crashy_ops,
};
"#,
    )
    .unwrap();
    let include = format!("-I{}", timer_source().parent().unwrap().display());
    build(dir.path(), &crashy, "libcrashy.so", &[&include]);
    let machine = r#"
name = "contained"

[[driver]]
library = "libcrashy.so"

[[device]]
name = "clock0"
model = "timer"
hz = 100

[[device]]
name = "disk0"
model = "virtio-blk"
backing = "mem:1M"
"#;
    let up = Up::start(dir.path(), Some(machine));
    // Each incarnation crashes 0.3 s after it starts. A client waiting 10 ticks at a time
    // gets every wait answered across the crashes (each is sent again to the next driver).
    let (mut c, _) = outboard_clock_client::open_clock(&up.control, "clock0").unwrap();
    for _ in 0..8 {
        let passed = c
            .wait(10)
            .expect("a wait failed across the C driver's crashes");
        assert!(passed >= 10, "{passed}");
    }
    // The crashes were the driver's, and each took only its server.
    let tree = common::registry(&up).to_string();
    assert!(tree.contains("SIGSEGV"), "no segfault recorded: {tree}");
    // The disk in another server served all along, and the manager too.
    let o = up.run_within(
        &["blk", "read", "disk0", "--length", "4096"],
        Duration::from_secs(30),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.stdout.len(), 4096);
}

/// A clock driver whose active probe crashes: it would win every timer (score 9000) if its
/// probe were not run, or if a crashing probe were taken for a bid.
const CRASHING_PROBE: &str = r#"#include <stddef.h>
#include <outboard/osenv.h>
#include <outboard/driver.h>
#include <outboard/clock.h>
static int start(const struct outboard_clock_sink *s, uint32_t *hz)
{
    (void)s;
    (void)hz;
    return OSENV_EIO;
}
static int now(uint64_t *ns)
{
    (void)ns;
    return OSENV_EIO;
}
static int probe(uint32_t *score, char *why, uint32_t size)
{
    (void)score;
    (void)why;
    (void)size;
    volatile int *p = NULL;
    *p = 1;
    return 0;
}
static const struct outboard_clock_ops ops = { .start = start, .now = now };
static const struct outboard_pci_id ids[] = { { 0x1234, 0x0b71 }, { 0, 0 } };
const struct outboard_driver outboard_driver = {
    .abi_version = OUTBOARD_DRIVER_ABI,
    .size = sizeof(struct outboard_driver),
    .name = "crashing-probe",
    .class_name = OUTBOARD_CLASS_CLOCK,
    .ids = ids,
    .score = 9000,
    .class_ops = &ops,
    .probe = probe,
};
"#;

/// The driver the registry shows for a timer on a machine of `libraries`: its name, its
/// probe score and the drivers that declined the timer, with why.
fn winner(dir: &Path, libraries: &[&str]) -> (String, String, String) {
    let mut machine = String::from("name = \"probing\"\n");
    for l in libraries {
        machine += &format!("[[driver]]\nlibrary = \"{l}\"\n");
    }
    machine += "[[device]]\nname = \"clock0\"\nmodel = \"timer\"\nhz = 200\n";
    let up = Up::start(dir, Some(&machine));
    let tree = common::registry(&up).to_string();
    let o = up.run_within(
        &["clock", "clock0", "--ticks", "20"],
        Duration::from_secs(60),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_str(&tree).unwrap();
    fn find(n: &serde_json::Value) -> Option<(String, String, String)> {
        if n["kind"] == "driver" && n.to_string().contains("\"clock0\"") {
            return Some((
                n["name"].as_str()?.to_string(),
                n["props"]["probe-score"].to_string(),
                n["props"]["declined"].as_str().unwrap_or("").to_string(),
            ));
        }
        n["children"].as_array()?.iter().find_map(find)
    }
    find(&v).unwrap_or_else(|| panic!("no driver for clock0 in {tree}"))
}

#[test]
fn a_library_drivers_active_probe_decides_its_bid_and_runs_outside_the_manager() {
    let dir = tempfile::tempdir().unwrap();
    let src = timer_source();
    // The descriptor bids 500, below the built-in driver's 1000; its probe bids 3000.
    build(
        dir.path(),
        &src,
        "libraiser.so",
        &[
            "-DTIMER_DRIVER_NAME=\"raiser\"",
            "-DTIMER_SCORE=500",
            "-DTIMER_PROBE_SCORE=3000",
        ],
    );
    // The descriptor bids 2000; its probe declines the timer's revision.
    build(
        dir.path(),
        &src,
        "libpicky.so",
        &[
            "-DTIMER_DRIVER_NAME=\"picky\"",
            "-DTIMER_SCORE=2000",
            "-DTIMER_MIN_REVISION=200",
        ],
    );
    let crashing = dir.path().join("crashing.c");
    std::fs::write(&crashing, CRASHING_PROBE).unwrap();
    build(dir.path(), &crashing, "libcrashing.so", &[]);

    let said = stdout(&driver_lib(&dir.path().join("libpicky.so")));
    assert!(said.contains("probe  yes"), "{said}");

    // The manager's child asked for a probe answers as the driver does.
    let ask = |lib: &str| {
        let mut child = Command::new(EXE)
            .arg("driver-lib")
            .arg(dir.path().join(lib))
            .arg("--probe")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // A timer's header: its ids, revision 1, a 64-bit memory BAR 0 of 4 KiB.
        let mut header = [0u8; 256];
        header[..4].copy_from_slice(&0x0b71_1234u32.to_le_bytes());
        header[8] = 1;
        header[0x10] = 0x4;
        let hex: String = header.iter().map(|b| format!("{b:02x}")).collect();
        let request =
            format!("{{\"header\":\"{hex}\",\"bar_sizes\":[4096,0,0,0,0,0],\"score\":7}}");
        std::io::Write::write_all(child.stdin.as_mut().unwrap(), request.as_bytes()).unwrap();
        drop(child.stdin.take());
        child.wait_with_output().unwrap()
    };
    let o = ask("libraiser.so");
    assert_eq!(stdout(&o).trim(), "{\"bid\":3000}", "{o:?}");
    let o = ask("libpicky.so");
    assert!(
        stdout(&o).contains("revision is older than this driver supports"),
        "{o:?}"
    );
    let o = ask("libcrashing.so");
    assert!(
        !o.status.success(),
        "a crashing probe crashes its child: {o:?}"
    );

    // In a machine: the probe's bid wins over the descriptor's; a declining probe and a
    // crashing one leave the device to the built-in driver, and the manager goes on.
    let (name, score, _) = winner(
        dir.path(),
        &["libraiser.so", "libpicky.so", "libcrashing.so"],
    );
    assert_eq!((name.as_str(), score.as_str()), ("raiser", "3000"));
    let (name, score, declined) = winner(dir.path(), &["libpicky.so", "libcrashing.so"]);
    assert_eq!((name.as_str(), score.as_str()), ("legacy-timer", "1000"));
    // `ls` says why the higher bids did not count.
    assert!(
        declined.contains("picky declined: its probe declines the device: the timer's revision")
            && declined.contains("crashing-probe declined: its probe failed"),
        "{declined}"
    );
}

fn native_timer_source() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../drivers/c/native_timer.c")
}

#[test]
fn a_native_c_driver_built_outside_the_tree_is_called_by_the_work_loop_and_serves_its_clock() {
    let dir = tempfile::tempdir().unwrap();
    build(
        dir.path(),
        &native_timer_source(),
        "libntimer.so",
        &[
            "-DTIMER_DRIVER_NAME=\"my-native-timer\"",
            "-DTIMER_SCORE=2000",
        ],
    );
    let said = stdout(&driver_lib(&dir.path().join("libntimer.so")));
    assert!(
        said.contains("my-native-timer") && said.contains("model  native"),
        "{said}"
    );
    serves_a_clock_across_a_kill(dir.path(), "libntimer.so", "my-native-timer");
}

#[test]
fn a_native_driver_missing_an_operation_is_refused_with_why() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("nchar.c");
    std::fs::write(
        &src,
        r#"#include <stddef.h>
#include <outboard/driver.h>
#include <outboard/char.h>
static const struct outboard_pci_id ids[] = { { 0x1b36, 0x0002 }, { 0, 0 } };
static long nothing(void *buf, unsigned long len) { (void)buf; (void)len; return 0; }
/* A legacy driver's table would be misread as this; here every entry but `read` is
   missing. */
static const struct outboard_native_char_ops ops = { .read = nothing };
const struct outboard_driver outboard_driver = {
    .abi_version = OUTBOARD_DRIVER_ABI,
    .size = sizeof(struct outboard_driver),
    .name = "native-char",
    .class_name = OUTBOARD_CLASS_CHAR,
    .ids = ids,
    .score = 5000,
    .class_ops = &ops,
    .model = OUTBOARD_MODEL_NATIVE,
};
"#,
    )
    .unwrap();
    let lib = build(dir.path(), &src, "libnchar.so", &[]);
    let o = driver_lib(&lib);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("a native char driver needs all of start, event, read, write"),
        "{e}"
    );
}

/// The timer driver, with initialisers a careless library has: one prints to standard output
/// (buffered by C's stdio, so it comes out at exit, after anything the program wrote), and
/// in the child that describes or probes it for the manager (`outboard driver-lib`), one
/// starts a helper that holds that child's pipes and, if it is still alive 2 s later, leaves
/// a mark.
const CARELESS: &str = r#"#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include "timer.c"
__attribute__((constructor)) static void careless(void)
{
    char cmd[256] = { 0 };
    int fd = open("/proc/self/cmdline", O_RDONLY);
    ssize_t n = fd >= 0 ? read(fd, cmd, sizeof cmd - 1) : 0;
    if (fd >= 0)
        close(fd);
    printf("hello from a library's initialiser\n");
    for (ssize_t i = 0; i < n; i++)
        if (!cmd[i])
            cmd[i] = ' ';
    if (!strstr(cmd, " driver-lib "))
        return;
    if (fork() == 0) {
        sleep(2);
        int m = open(MARK, O_CREAT | O_WRONLY, 0600);
        if (m >= 0)
            close(m);
        _exit(0);
    }
}
"#;

#[test]
fn a_library_that_prints_and_leaves_helpers_behind_is_still_read_right_and_its_helpers_go() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("careless.c");
    std::fs::write(&src, CARELESS).unwrap();
    let mark = dir.path().join("helper-survived");
    let include = format!("-I{}", timer_source().parent().unwrap().display());
    let define_mark = format!("-DMARK=\"{}\"", mark.display());
    let lib = build(
        dir.path(),
        &src,
        "libcareless.so",
        &[
            &include,
            &define_mark,
            "-DTIMER_DRIVER_NAME=\"careless\"",
            "-DTIMER_SCORE=2000",
            "-D_DEFAULT_SOURCE",
        ],
    );
    // What the manager reads: the description alone on standard output.
    let o = Command::new(EXE)
        .arg("driver-lib")
        .arg(&lib)
        .arg("--json")
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let out = stdout(&o);
    assert_eq!(out.lines().count(), 1, "{out}");
    assert!(out.contains("\"name\":\"careless\""), "{out}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("hello from a library"));
    // This helper is the test's to wait for: it is not in a group the manager kills.
    std::thread::sleep(Duration::from_millis(2500));
    let _ = std::fs::remove_file(&mark);

    // Under `outboard up`: described and probed (its probe runs in a child) and chosen; the
    // helpers those children started went with them.
    let (name, _, _) = winner(dir.path(), &["libcareless.so"]);
    assert_eq!(name, "careless");
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        !mark.exists(),
        "a helper of the manager's child outlived it and left its mark"
    );
}
