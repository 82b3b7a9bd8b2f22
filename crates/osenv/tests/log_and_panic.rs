//! `osenv_log`/`osenv_vlog` format their arguments into the server's log with the driver's
//! name, and `osenv_panic` logs its message and ends the process (SIGABRT): the crash of a C
//! driver is its process's, which its supervisor restarts. Checked in a child process (this
//! test binary run again), since the panic ends it.

use std::ffi::{c_char, c_int};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use outboard_osenv::Osenv;

unsafe extern "C" {
    fn osenv_log(priority: c_int, fmt: *const c_char, ...);
    fn osenv_panic(fmt: *const c_char, ...) -> !;
}

const CHILD: &str = "OUTBOARD_OSENV_PANIC_CHILD";

/// In the child: a driver that logs, then panics.
fn child() -> ! {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let env = Osenv::new("panicky").unwrap();
    let _in = env.enter();
    // SAFETY: NUL-terminated formats whose conversions match the arguments' C types.
    unsafe {
        osenv_log(6, c"logged %d %s".as_ptr(), 42 as c_int, c"words".as_ptr());
        osenv_panic(c"gave up after %d tries".as_ptr(), 3 as c_int)
    }
}

#[test]
fn a_driver_logs_with_its_name_and_its_panic_ends_the_process() {
    if std::env::var_os(CHILD).is_some() {
        child();
    }
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_driver_logs_with_its_name_and_its_panic_ends_the_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = c.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            // Our own child, still ours (not reaped): safe to kill.
            let _ = c.kill();
            panic!("the panicking driver's process did not end");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(c.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(
        status.signal(),
        Some(6),
        "ended by SIGABRT: {status:?}\n{err}"
    );
    assert!(
        err.lines()
            .any(|l| l.contains("logged 42 words") && l.contains("panicky")),
        "the log line, formatted, with the driver's name:\n{err}"
    );
    assert!(
        err.contains("gave up after 3 tries"),
        "the panic's message:\n{err}"
    );
}
