//! The command lines of the children the manager starts, as typed descriptions shared with
//! the command line's parser: the manager fills a struct and writes it out ([`ConfineArgs::to_args`],
//! [`DriverHostArgs::command_line`]); the child, the same `outboard` binary, parses it back into
//! the same struct with clap. A test holds that what is written parses back to the same value,
//! so the two sides cannot drift apart. (A device model's own arguments come from its entry in
//! [`crate::models`]; its common ones are still written by hand.)

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

// `--confine` and `--check-confinement` for the roles that touch devices (driver servers and
// device models); a plain comment, as clap would show a doc comment as the role's help.
#[allow(missing_docs)]
#[derive(Args, Debug, Clone, PartialEq)]
pub struct ConfineArgs {
    /// Once started, drop every privilege serving does not need: a seccomp allow-list, Landlock
    /// with no filesystem and no network, no_new_privs, resource limits (what `outboard up`
    /// starts its children with). The process then opens nothing new.
    #[arg(long)]
    pub confine: bool,
    /// Confine, then try what a compromised driver would (open FILE, connect to SOCKET, create
    /// sockets, ptrace and signal process PID, stat by path, FIFREEZE/FS_IOC_SETFLAGS/
    /// SIOCSIFFLAGS/TIOCSTI ioctls and F_SETOWN/F_SETSIG/F_SETLEASE/F_NOTIFY fcntls on fd -1,
    /// start a process, execve, map executable memory) and print each result instead of
    /// serving. Exits 0 if every attempt was
    /// refused, 1 if any worked.
    #[arg(long, num_args = 3, value_names = ["FILE", "SOCKET", "PID"])]
    pub check_confinement: Option<Vec<String>>,
    /// With --confine: run as this user (a name from /etc/passwd, or UID:GID) once started.
    /// Capabilities are dropped either way.
    #[arg(long, value_name = "USER")]
    pub user: Option<outboard_confine::privileges::User>,
    /// With --confine: refuse to serve unless every layer holds in full (Landlock enforced
    /// on every thread, not only partly, as on kernels older than the ruleset).
    #[arg(long)]
    pub require_confinement: bool,
    /// With --confine: most descriptors it may hold (RLIMIT_NOFILE, at most 4096).
    #[arg(long, value_name = "N", default_value_t = outboard_confine::limits::MAX_FILES)]
    pub max_files: u64,
    /// With --confine: most bytes of address space it may map (RLIMIT_AS), e.g. 4G
    /// [default: unlimited; `outboard up` gives 16G unless the machine says otherwise].
    #[arg(long, value_name = "SIZE", value_parser = |s: &str| outboard_devices::backing::parse_size(s).ok_or("a size, e.g. 4G"))]
    pub max_memory: Option<u64>,
}

impl ConfineArgs {
    /// Whether the process will be confined.
    pub fn confined(&self) -> bool {
        self.confine || self.check_confinement.is_some()
    }

    /// First thing, before the process starts any thread: if it will be confined, become
    /// `--user` and drop every capability, so that no thread ever holds one. `dma` raises
    /// `RLIMIT_MEMLOCK` first for a driver that maps DMA through VFIO (what `CAP_IPC_LOCK`
    /// would have waived).
    pub fn drop_privileges(&self, dma: bool) -> Result<(), String> {
        if !self.confined() {
            return Ok(());
        }
        let dropped =
            outboard_confine::privileges::drop_privileges(self.user, dma.then_some(u64::MAX))
                .map_err(|e| e.to_string())?;
        tracing::info!("privileges: {dropped}");
        Ok(())
    }

    /// Confines the process as `role` if asked to, right before it serves. With
    /// `--check-confinement`, probes and returns the exit code the process ends with instead
    /// of serving.
    pub fn apply(&self, role: outboard_confine::Role) -> Result<Option<ExitCode>, String> {
        if !self.confined() {
            return Ok(None);
        }
        let targets = self
            .check_confinement
            .as_ref()
            .map(|v| {
                let pid = v[2]
                    .parse()
                    .map_err(|_| format!("--check-confinement: {:?} is not a pid", v[2]))?;
                Ok::<_, String>(outboard_confine::probe::Targets {
                    file: PathBuf::from(&v[0]),
                    socket: PathBuf::from(&v[1]),
                    pid,
                })
            })
            .transpose()?;
        let caps = outboard_confine::limits::Caps {
            files: self.max_files,
            memory: self.max_memory,
        };
        let report = outboard_confine::confine(role, caps).map_err(|e| e.to_string())?;
        eprintln!("outboard: {report}");
        if !report.landlock_complete {
            if self.require_confinement {
                return Err(format!(
                    "--require-confinement: landlock {}; refusing to serve",
                    report.landlock
                ));
            }
            eprintln!(
                "outboard: warning: Landlock is not complete here (landlock {}); the seccomp \
                 filter still holds on every thread. --require-confinement refuses to run so",
                report.landlock
            );
        }
        let Some(targets) = targets else {
            return Ok(None);
        };
        let attempts = outboard_confine::probe::attempts(&targets, |a| println!("{a}"));
        let escaped = attempts.iter().filter(|a| !a.denied()).count();
        println!(
            "{} of {} attempts refused",
            attempts.len() - escaped,
            attempts.len()
        );
        Ok(Some(if escaped == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }))
    }
}

impl ConfineArgs {
    /// The arguments that give this confinement back when parsed.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        if self.confine {
            a.push("--confine".into());
        }
        if let Some(v) = &self.check_confinement {
            a.push("--check-confinement".into());
            a.extend(v.iter().cloned());
        }
        if let Some(u) = &self.user {
            a.extend(["--user".into(), u.to_string()]);
        }
        if self.require_confinement {
            a.push("--require-confinement".into());
        }
        a.extend(["--max-files".into(), self.max_files.to_string()]);
        if let Some(m) = self.max_memory {
            a.extend(["--max-memory".into(), m.to_string()]);
        }
        a
    }
}

// `outboard driver-host`: what a driver server is started with.
#[allow(missing_docs)]
#[derive(Args, Debug, Clone, PartialEq)]
pub struct DriverHostArgs {
    /// Control socket (SEQPACKET) to serve sessions on.
    #[arg(long, value_name = "PATH", required_unless_present = "listen_fd")]
    pub listen: Option<PathBuf>,
    /// A listening SEQPACKET socket inherited as this descriptor, instead of --listen (what
    /// the manager passes: a confined server opens no path).
    #[arg(long, value_name = "FD", conflicts_with = "listen")]
    pub listen_fd: Option<i32>,
    /// A device to drive, as NAME=SPEC (SPEC: vfio-user:PATH, vfio:BDF, or null:SIZE for the
    /// null block device, which completes requests without a device). Repeat to host several
    /// drivers in one server.
    #[arg(long = "device", value_name = "NAME=SPEC", required = true)]
    pub devices: Vec<String>,
    /// The driver (personality) to start for a device, as NAME=DRIVER (`virtio-blk`,
    /// `null-blk`). The manager passes the driver its catalog matched; without it, the best
    /// match for the device is started.
    #[arg(long = "driver", value_name = "NAME=DRIVER")]
    pub drivers: Vec<String>,
    /// Poll for new requests this many microseconds after the last one before sleeping
    /// (0: sleep at once). Saves a wake-up per request for busy clients; idle cost is nil.
    #[arg(long, default_value_t = 20)]
    pub spin_us: u64,
    /// An inherited SEQPACKET socket to report events (device failures) to the manager on.
    #[arg(long, value_name = "FD")]
    pub notify_fd: Option<i32>,
    /// Milliseconds a request may stay in a device before the device counts as stalled and
    /// is given up (its requests fail with "device failed").
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub deadline_ms: u64,
    /// A supervisor restarts this server and its clients resume their sessions: a device that
    /// fails ends the server (exit status 75) with its requests unanswered, for the clients
    /// to send again, instead of failing them.
    #[arg(long)]
    pub restartable: bool,
    /// Grant no new range lock for this many milliseconds after start (a restarted server:
    /// the previous one's sessions resume and claim their locks back first).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub lock_grace_ms: u64,
    /// For this many milliseconds after start, let one request at a time into each device and
    /// name it in the heartbeat page first (the manager passes it after a crash: another
    /// crash then names the request that caused it).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub isolate_ms: u64,
    /// Fail this request once, alone, instead of sending it to its device: it crashed the
    /// driver too often (KEY:W0:W1: the session key and the class's fingerprint of the request, as the manager names it). Repeatable.
    #[arg(long, value_name = "REQUEST")]
    pub quarantine: Vec<outboard_server::blame::Suspect>,
    /// Start with this device quiesced: requests to it wait until the manager resumes it
    /// (a server restarted while the device was suspended). Repeatable.
    #[arg(long, value_name = "NAME")]
    pub quiesce: Vec<String>,
    #[command(flatten)]
    pub confine: ConfineArgs,
}

impl DriverHostArgs {
    /// A driver server on an inherited listening socket, for the devices given as
    /// `(name, spec)`, with the defaults the command line has.
    pub fn on_fd(listen_fd: i32, confine: ConfineArgs) -> Self {
        Self {
            listen: None,
            listen_fd: Some(listen_fd),
            devices: Vec::new(),
            drivers: Vec::new(),
            spin_us: 20,
            notify_fd: None,
            deadline_ms: 30_000,
            restartable: false,
            lock_grace_ms: 0,
            isolate_ms: 0,
            quarantine: Vec::new(),
            quiesce: Vec::new(),
            confine,
        }
    }

    /// The whole command line after the program's name: `driver-host` and its arguments.
    pub fn command_line(&self) -> Vec<String> {
        let mut a = vec!["driver-host".to_string()];
        if let Some(p) = &self.listen {
            a.extend(["--listen".into(), p.display().to_string()]);
        }
        if let Some(fd) = self.listen_fd {
            a.extend(["--listen-fd".into(), fd.to_string()]);
        }
        for d in &self.devices {
            a.extend(["--device".into(), d.clone()]);
        }
        for d in &self.drivers {
            a.extend(["--driver".into(), d.clone()]);
        }
        a.extend(["--spin-us".into(), self.spin_us.to_string()]);
        if let Some(fd) = self.notify_fd {
            a.extend(["--notify-fd".into(), fd.to_string()]);
        }
        a.extend(["--deadline-ms".into(), self.deadline_ms.to_string()]);
        if self.restartable {
            a.push("--restartable".into());
        }
        a.extend(["--lock-grace-ms".into(), self.lock_grace_ms.to_string()]);
        a.extend(["--isolate-ms".into(), self.isolate_ms.to_string()]);
        for q in &self.quarantine {
            a.extend(["--quarantine".into(), q.to_string()]);
        }
        for n in &self.quiesce {
            a.extend(["--quiesce".into(), n.clone()]);
        }
        a.extend(self.confine.to_args());
        a
    }

    /// Starts (or stops) with device `name` quiesced.
    pub fn set_quiesced(&mut self, name: &str, on: bool) {
        self.quiesce.retain(|n| n != name);
        if on {
            self.quiesce.push(name.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Command,
    }

    #[derive(clap::Subcommand)]
    enum Command {
        DriverHost(DriverHostArgs),
    }

    #[test]
    fn what_the_manager_writes_the_child_parses_back_the_same() {
        let mut a = DriverHostArgs::on_fd(
            4,
            ConfineArgs {
                confine: true,
                check_confinement: None,
                user: Some("65534:65534".parse().unwrap()),
                require_confinement: true,
                max_files: 512,
                max_memory: Some(1 << 30),
            },
        );
        a.devices = vec!["disk0=vfio-user-fd:5".into(), "null0=null:1048576".into()];
        a.drivers = vec!["disk0=virtio-blk".into()];
        a.notify_fd = Some(3);
        a.deadline_ms = 1500;
        a.restartable = true;
        a.lock_grace_ms = 250;
        a.isolate_ms = 2000;
        a.quarantine = vec!["77:100000008:800".parse().unwrap()];
        a.set_quiesced("disk0", true);
        let line: Vec<String> = std::iter::once("outboard".to_string())
            .chain(a.command_line())
            .collect();
        let Command::DriverHost(back) = Cli::try_parse_from(&line).unwrap().command;
        assert_eq!(back, a, "{line:?}");
        // And the defaults: a server as plain as the command line makes it.
        let plain = DriverHostArgs::on_fd(
            4,
            ConfineArgs {
                confine: false,
                check_confinement: None,
                user: None,
                require_confinement: false,
                max_files: outboard_confine::limits::MAX_FILES,
                max_memory: None,
            },
        );
        let mut minimal = vec![
            "outboard".to_string(),
            "driver-host".into(),
            "--listen-fd".into(),
            "4".into(),
        ];
        minimal.extend(["--device".into(), "x=null:4096".into()]);
        let Command::DriverHost(parsed) = Cli::try_parse_from(&minimal).unwrap().command;
        let mut expected = plain;
        expected.devices = vec!["x=null:4096".into()];
        assert_eq!(parsed, expected);
    }
}
