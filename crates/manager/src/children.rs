//! The command lines of the children the manager starts, as typed descriptions shared with
//! the command line's parser: the manager fills a struct and writes it out ([`ConfineArgs::to_args`],
//! [`DriverHostArgs::command_line`]); the child, the same `outboard` binary, parses it back into
//! the same struct with clap. A test holds that what is written parses back to the same value,
//! so the two sides cannot drift apart: a driver server ([`DriverHostArgs`]), a device model
//! ([`ModelArgs`]: its common part and its own arguments, [`ModelOwn`]) and an NBD export
//! ([`ExportNbdArgs`]). The device model's test is the command line's own (`outboard device`
//! parses what [`ModelArgs::command_line`] writes, in the `outboard` binary's tests).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use outboard_devices::faults::Fault;

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

impl Default for ConfineArgs {
    /// Not confined, with the command line's defaults (a process run by hand).
    fn default() -> Self {
        Self {
            confine: false,
            check_confinement: None,
            user: None,
            require_confinement: false,
            max_files: outboard_confine::limits::MAX_FILES,
            max_memory: None,
        }
    }
}

/// Why a child could not confine itself as asked: it ends with this message.
#[derive(Debug, thiserror::Error)]
pub enum ConfineFailed {
    /// A layer could not be applied (privileges, limits, Landlock, seccomp).
    #[error(transparent)]
    Confine(#[from] outboard_confine::ConfineError),
    /// `--check-confinement`'s third value is not a process id.
    #[error("--check-confinement: {0:?} is not a pid")]
    NotAPid(String),
    /// `--require-confinement`, and Landlock holds only in part here.
    #[error("--require-confinement: landlock {0}; refusing to serve")]
    Incomplete(String),
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
    pub fn drop_privileges(&self, dma: bool) -> Result<(), ConfineFailed> {
        if !self.confined() {
            return Ok(());
        }
        let dropped =
            outboard_confine::privileges::drop_privileges(self.user, dma.then_some(u64::MAX))?;
        tracing::info!("privileges: {dropped}");
        Ok(())
    }

    /// Confines the process as `role` if asked to, right before it serves. With
    /// `--check-confinement`, probes and returns the exit code the process ends with instead
    /// of serving.
    pub fn apply(&self, role: outboard_confine::Role) -> Result<Option<ExitCode>, ConfineFailed> {
        if !self.confined() {
            return Ok(None);
        }
        let targets = self.probe_targets()?;
        let began = std::time::Instant::now();
        let report = outboard_confine::confine(role, self.caps())?;
        tracing::debug!("confined in {:?}", began.elapsed());
        self.confined_as(report, targets)
    }

    /// Confines the process as `role` ahead of need, if asked to be confined and not to check
    /// its confinement: before it opens its device (a standby driver server, while it waits).
    /// [`ConfineArgs::finish`] ends it where [`ConfineArgs::apply`] would have confined it.
    pub fn apply_early(
        &self,
        role: outboard_confine::Role,
    ) -> Result<Option<outboard_confine::Early>, ConfineFailed> {
        if !self.confine || self.check_confinement.is_some() {
            return Ok(None);
        }
        let began = std::time::Instant::now();
        let early = outboard_confine::confine_early(role, self.caps())?;
        tracing::debug!("confined early in {:?}", began.elapsed());
        Ok(Some(early))
    }

    /// Finishes an early confinement, right before the process serves; the same report and
    /// checks as [`ConfineArgs::apply`].
    pub fn finish(
        &self,
        early: outboard_confine::Early,
    ) -> Result<Option<ExitCode>, ConfineFailed> {
        let began = std::time::Instant::now();
        let report = early.finish()?;
        tracing::debug!("confinement finished in {:?}", began.elapsed());
        self.confined_as(report, None)
    }

    fn caps(&self) -> outboard_confine::limits::Caps {
        outboard_confine::limits::Caps {
            files: self.max_files,
            memory: self.max_memory,
        }
    }

    fn probe_targets(&self) -> Result<Option<outboard_confine::probe::Targets>, ConfineFailed> {
        self.check_confinement
            .as_ref()
            .map(|v| {
                let pid = v[2]
                    .parse()
                    .map_err(|_| ConfineFailed::NotAPid(v[2].clone()))?;
                Ok(outboard_confine::probe::Targets {
                    file: PathBuf::from(&v[0]),
                    socket: PathBuf::from(&v[1]),
                    pid,
                })
            })
            .transpose()
    }

    /// Says how the process is confined, refuses to go on if Landlock is incomplete and
    /// `--require-confinement` says so, and probes `targets` if given.
    fn confined_as(
        &self,
        report: outboard_confine::Report,
        targets: Option<outboard_confine::probe::Targets>,
    ) -> Result<Option<ExitCode>, ConfineFailed> {
        outboard_sys::errln!("outboard: {report}");
        if !report.landlock_complete {
            if self.require_confinement {
                return Err(ConfineFailed::Incomplete(report.landlock.to_string()));
            }
            outboard_sys::errln!(
                "outboard: warning: Landlock is not complete here (landlock {}); the seccomp \
                 filter still holds on every thread. --require-confinement refuses to run so",
                report.landlock
            );
        }
        let Some(targets) = targets else {
            return Ok(None);
        };
        let attempts = outboard_confine::probe::attempts(&targets, |a| outboard_sys::outln!("{a}"));
        let escaped = attempts.iter().filter(|a| !a.denied()).count();
        outboard_sys::outln!(
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
    /// `virtio-drivers-blk` (the virtio-drivers crate's, hosted unmodified), `null-blk`,
    /// `virtio-rng`, `virtio-net`, `legacy-timer` (the C driver), `timer` (the native one),
    /// `uart16550` (the C 16550 driver), or a library's driver). The manager passes the driver
    /// its catalog matched; without it, the best match for the device is started.
    #[arg(long = "driver", value_name = "NAME=DRIVER")]
    pub drivers: Vec<String>,
    /// Load a C driver from this shared object (`include/outboard/driver.h`) into the
    /// catalog before any device is started: it is matched, and may be named by --driver,
    /// like a built-in one. Repeatable.
    #[arg(long = "driver-lib", value_name = "PATH.so")]
    pub driver_libs: Vec<PathBuf>,
    /// Fault injection: the driver of device NAME aborts the server whenever a request
    /// touches SECTOR, every time (a request that kills its driver). Repeatable.
    #[arg(long = "driver-abort-on", value_name = "NAME=SECTOR")]
    pub driver_abort_on: Vec<String>,
    /// Measurement (`outboard bench clock`): a thread holds the legacy driver of device NAME
    /// nearly all the time, doing counted work, and writes to PATH what the driver's
    /// interrupts took from it. Repeatable; never set by the manager.
    #[arg(long = "contend", value_name = "NAME=PATH", hide = true)]
    pub contend: Vec<String>,
    /// Poll for new requests this many microseconds after the last one before sleeping
    /// (0: sleep at once). Saves a wake-up per request for busy clients; idle cost is nil.
    #[arg(long, default_value_t = 20)]
    pub spin_us: u64,
    /// Keep no per-device or per-session counters (they cost nothing measurable; this is for
    /// measuring that: `outboard bench counters`).
    #[arg(long)]
    pub no_counters: bool,
    /// An inherited SEQPACKET socket to report events (device failures) to the manager on.
    #[arg(long, value_name = "FD")]
    pub notify_fd: Option<i32>,
    /// Milliseconds a request may stay in a device before the device counts as stalled and
    /// is given up: its requests fail with "timed out" once it cannot carry them out (it was
    /// reset, or re-opened); with --restartable the server ends and they are sent again.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub deadline_ms: u64,
    /// A supervisor restarts this server and its clients resume their sessions: a device that
    /// fails ends the server (exit status 75) with its requests unanswered, for the clients
    /// to send again, instead of failing them.
    #[arg(long)]
    pub restartable: bool,
    /// For this many milliseconds after start, resuming sessions come first (a restarted
    /// server: what the previous one's sessions kept — block's range locks — is claimed back
    /// before anyone else is granted anything).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub resume_grace_ms: u64,
    /// For this many milliseconds after start, let one request at a time into each device and
    /// name it in the heartbeat page first (the manager passes it after a crash: another
    /// crash then names the request that caused it).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub isolate_ms: u64,
    /// Fail this request once, alone, instead of sending it to its device: it crashed the
    /// driver too often (KEY:W0:W1: the session key and the class's fingerprint of the request, as the manager names it). Repeatable.
    #[arg(long, value_name = "REQUEST")]
    pub quarantine: Vec<outboard_server::blame::Suspect>,
    /// While isolated, let this request into its device only after another one has been
    /// through it: it was in the device at the last crash, and the request a replay sends
    /// first is not to be named at every crash for being first (KEY:W0:W1). Repeatable.
    #[arg(long, value_name = "REQUEST")]
    pub hold_back: Vec<outboard_server::blame::Suspect>,
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
            driver_libs: Vec::new(),
            driver_abort_on: Vec::new(),
            contend: Vec::new(),
            spin_us: 20,
            no_counters: false,
            notify_fd: None,
            deadline_ms: 30_000,
            restartable: false,
            resume_grace_ms: 0,
            isolate_ms: 0,
            quarantine: Vec::new(),
            hold_back: Vec::new(),
            quiesce: Vec::new(),
            confine,
        }
    }

    /// The whole command line after the program's name: `driver-host` and its arguments.
    pub fn command_line(&self) -> Vec<String> {
        let mut a = Line::of(["driver-host"]);
        a.opt("--listen", self.listen.as_ref().map(|p| p.display()));
        a.opt("--listen-fd", self.listen_fd);
        a.each("--device", &self.devices);
        a.each("--driver", &self.drivers);
        a.each(
            "--driver-lib",
            &self
                .driver_libs
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>(),
        );
        a.each("--driver-abort-on", &self.driver_abort_on);
        a.each("--contend", &self.contend);
        a.opt("--spin-us", Some(self.spin_us));
        a.flag("--no-counters", self.no_counters);
        a.opt("--notify-fd", self.notify_fd);
        a.opt("--deadline-ms", Some(self.deadline_ms));
        a.flag("--restartable", self.restartable);
        a.opt("--resume-grace-ms", Some(self.resume_grace_ms));
        a.opt("--isolate-ms", Some(self.isolate_ms));
        a.each("--quarantine", &self.quarantine);
        a.each("--hold-back", &self.hold_back);
        a.each("--quiesce", &self.quiesce);
        a.0.extend(self.confine.to_args());
        a.0
    }

    /// Starts (or stops) with device `name` quiesced.
    pub fn set_quiesced(&mut self, name: &str, on: bool) {
        self.quiesce.retain(|n| n != name);
        if on {
            self.quiesce.push(name.to_string());
        }
    }
}

impl ExportNbdArgs {
    /// The class of the devices an NBD export serves.
    pub const CLASS: &'static str = "block";
}

// `outboard export nbd`: what an export is started with (a plain comment: clap shows doc
// comments as help).
#[allow(missing_docs)]
#[derive(Args, Debug, Clone, PartialEq)]
pub struct ExportNbdArgs {
    /// Block devices to export, each under its own name (the first is also the default
    /// export, "").
    #[arg(required = true, value_name = "DEVICE")]
    pub devices: Vec<String>,
    /// Listen on a UNIX socket at PATH [default: nbd.sock in the runtime directory].
    #[arg(long, value_name = "PATH", conflicts_with = "listen")]
    pub socket: Option<PathBuf>,
    /// Listen on TCP, e.g. 127.0.0.1:10809 (NBD's port). An address other than loopback is
    /// refused without --tls-cert (anyone who reaches it could read and write the disk), unless
    /// --insecure is given.
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: Option<SocketAddr>,
    /// The export's name, when exporting one device [default: the device's name].
    #[arg(long)]
    pub name: Option<String>,
    /// Refuse writes (and trims, write-zeroes) from clients.
    #[arg(long)]
    pub read_only: bool,
    /// Require TLS (NBD_OPT_STARTTLS) with this certificate chain (PEM, leaf first); clients
    /// then use nbds:// URIs.
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require a client certificate signed by one of these certificate authorities (PEM), as
    /// qemu-nbd's and nbdkit's verify-peer: only clients holding such a certificate and its
    /// key get in. Without it, TLS authenticates the server only.
    #[arg(long, value_name = "CA_PEM", requires = "tls_cert")]
    pub tls_verify_peer: Option<PathBuf>,
    /// Require TLS with pre-shared keys from FILE instead of certificates: one
    /// `identity:hexkey` per line, as nbdkit's --tls-psk and GnuTLS's psktool write it.
    /// Clients use e.g. nbds://alice@host/disk0?tls-psk-file=FILE.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["tls_cert", "tls_key"])]
    pub tls_psk: Option<PathBuf>,
    /// Serve a TCP address other than loopback without TLS (a trusted network only).
    #[arg(long)]
    pub insecure: bool,
    /// Serve at most this many connections at once; more are refused during negotiation with
    /// the reason (NBD_REP_ERR_POLICY).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub max_connections: u64,
    /// Close a connection that has not finished negotiating after this long without a message
    /// (e.g. 10s).
    #[arg(long, default_value = "10s", value_parser = duration)]
    pub handshake_timeout: std::time::Duration,
    /// Close a connection that sends no request for this long [default: never, as qemu-nbd].
    #[arg(long, value_parser = duration)]
    pub idle_timeout: Option<std::time::Duration>,
    /// Close a connection whose client takes no reply data for this long.
    #[arg(long, default_value = "30s", value_parser = duration)]
    pub write_timeout: std::time::Duration,
    /// (internal) Report clients to the manager on this inherited descriptor.
    #[arg(long, hide = true, value_name = "FD")]
    pub notify_fd: Option<i32>,
    /// (internal) Ask the manager, and have it connect to driver servers, on this inherited
    /// connection (what `outboard up` gives its exports): the export then may not connect
    /// anywhere itself.
    #[arg(long, hide = true, value_name = "FD")]
    pub broker_fd: Option<i32>,
    /// Once listening (and its TLS keys read), run as this user (a name from /etc/passwd, or
    /// UID:GID). Capabilities are dropped either way.
    #[arg(long, value_name = "USER")]
    pub user: Option<outboard_confine::privileges::User>,
    /// Refuse to serve unless every confinement layer holds in full (Landlock on every
    /// thread); by default a kernel without some of it gets a warning.
    #[arg(long, conflicts_with = "no_confine")]
    pub require_confinement: bool,
    /// Most descriptors it may hold (RLIMIT_NOFILE, at most 4096): each connection takes one.
    #[arg(long, value_name = "N", default_value_t = outboard_confine::limits::MAX_FILES, value_parser = clap::value_parser!(u64).range(32..=4096))]
    pub max_files: u64,
    /// Most bytes of address space it may map (RLIMIT_AS), e.g. 4G [default: unlimited;
    /// `outboard up` gives 16G unless the machine says otherwise].
    #[arg(long, value_name = "SIZE", value_parser = |s: &str| outboard_devices::backing::parse_size(s).filter(|n| *n >= 64 << 20).ok_or("a size of at least 64M, e.g. 4G"))]
    pub max_memory: Option<u64>,
    /// Serve without the seccomp allow-list and Landlock the export applies to itself once
    /// it listens (it still drops every capability). For finding out whether confinement
    /// is what breaks something; not for use.
    #[arg(long)]
    pub no_confine: bool,
}

fn duration(s: &str) -> Result<std::time::Duration, String> {
    crate::config::parse_duration(s).ok_or_else(|| format!("{s:?}: e.g. 500ms, 30s"))
}

impl ExportNbdArgs {
    /// An export of `devices` with the defaults the command line has.
    pub fn of(devices: Vec<String>) -> Self {
        Self {
            devices,
            socket: None,
            listen: None,
            name: None,
            read_only: false,
            tls_cert: None,
            tls_key: None,
            tls_verify_peer: None,
            tls_psk: None,
            insecure: false,
            max_connections: crate::config::DEFAULT_MAX_CONNECTIONS,
            handshake_timeout: crate::config::DEFAULT_HANDSHAKE_TIMEOUT,
            idle_timeout: None,
            write_timeout: crate::config::DEFAULT_WRITE_TIMEOUT,
            notify_fd: None,
            broker_fd: None,
            user: None,
            require_confinement: false,
            max_files: outboard_confine::limits::MAX_FILES,
            max_memory: None,
            no_confine: false,
        }
    }

    /// The command line after the program's name and its global flags: `export nbd` and its
    /// arguments.
    pub fn command_line(&self) -> Vec<String> {
        let ms = |d: std::time::Duration| format!("{}ms", d.as_millis());
        let mut a = Line::of(["export", "nbd"]);
        a.0.extend(self.devices.iter().cloned());
        a.opt("--socket", self.socket.as_ref().map(|p| p.display()));
        a.opt("--listen", self.listen);
        a.opt("--name", self.name.as_ref());
        a.opt("--tls-cert", self.tls_cert.as_ref().map(|p| p.display()));
        a.opt("--tls-key", self.tls_key.as_ref().map(|p| p.display()));
        a.opt(
            "--tls-verify-peer",
            self.tls_verify_peer.as_ref().map(|p| p.display()),
        );
        a.opt("--tls-psk", self.tls_psk.as_ref().map(|p| p.display()));
        a.opt("--max-connections", Some(self.max_connections));
        a.opt("--handshake-timeout", Some(ms(self.handshake_timeout)));
        a.opt("--idle-timeout", self.idle_timeout.map(ms));
        a.opt("--write-timeout", Some(ms(self.write_timeout)));
        a.opt("--notify-fd", self.notify_fd);
        a.opt("--broker-fd", self.broker_fd);
        a.opt("--user", self.user);
        a.opt("--max-files", Some(self.max_files));
        a.opt("--max-memory", self.max_memory);
        a.flag("--require-confinement", self.require_confinement);
        a.flag("--read-only", self.read_only);
        a.flag("--insecure", self.insecure);
        a.flag("--no-confine", self.no_confine);
        a.0
    }
}

// Where a device model listens (`outboard device MODEL`).
#[allow(missing_docs)]
#[derive(Args, Debug, Clone, PartialEq)]
pub struct ModelListen {
    /// Path of the vfio-user socket to create.
    #[arg(
        long,
        visible_alias = "socket-path",
        value_name = "PATH",
        required_unless_present = "fd"
    )]
    pub socket: Option<PathBuf>,
    /// An already listening socket inherited as this fd (instead of --socket).
    #[arg(long, value_name = "FD", conflicts_with = "socket")]
    pub fd: Option<i32>,
    /// An inherited SEQPACKET socket to tell the manager on that the model is ready.
    #[arg(long, value_name = "FD")]
    pub notify_fd: Option<i32>,
}

// Fault injection in a device model: bad hardware on demand.
#[allow(missing_docs)]
#[derive(Args, Debug, Clone, PartialEq)]
pub struct ModelFaults {
    /// Arm a fault from the start (repeatable): error=START-END, error-next=N, drop-irq=N,
    /// duplicate-irq=N, spurious-irq=N, corrupt-used=id|len, stall=DURATION, needs-reset,
    /// crash.
    #[arg(long = "fault", value_name = "FAULT", value_parser = parse_fault)]
    pub faults: Vec<Fault>,
    /// Also accept faults at run time on this SEQPACKET socket (what `outboard fault` uses).
    #[arg(long, value_name = "PATH")]
    pub faults_socket: Option<PathBuf>,
    /// The same, on a listening socket inherited as this descriptor (what the manager passes).
    #[arg(long, value_name = "FD", conflicts_with = "faults_socket")]
    pub faults_fd: Option<i32>,
}

fn parse_fault(s: &str) -> Result<Fault, String> {
    s.parse()
}

/// Options every disk model takes (virtio-blk and the null-blk device model).
#[allow(missing_docs)]
#[derive(Args, Debug, Clone, PartialEq)]
pub struct DiskOptions {
    /// Present the disk read-only.
    #[arg(long)]
    pub read_only: bool,
    /// Number of request queues.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    pub queues: u16,
    /// Serial number returned by GET_ID (at most 20 bytes).
    #[arg(long, default_value = DEFAULT_SERIAL)]
    pub serial: String,
}

/// The serial number a disk model reports unless told otherwise.
pub const DEFAULT_SERIAL: &str = "outboard-blk";

impl DiskOptions {
    fn write(&self, a: &mut Line) {
        a.flag("--read-only", self.read_only);
        a.opt("--queues", Some(self.queues));
        a.opt(
            "--serial",
            (self.serial != DEFAULT_SERIAL).then_some(&self.serial),
        );
    }
}

/// virtio-blk's own arguments: what holds the disk, and the disk's options.
#[allow(missing_docs)]
#[derive(Args, Debug, Clone, PartialEq)]
pub struct VirtioBlkOwn {
    /// What holds the disk's bytes: a file path, or mem:SIZE for zero-filled memory
    /// (SIZE with an optional K/M/G/T suffix), or fd:N for a file or memory inherited as
    /// descriptor N (what the manager passes).
    #[arg(long, value_name = "FILE|mem:SIZE|fd:N")]
    pub backing: String,
    /// Create the file with this size if it does not exist (sparse).
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg)]
    pub create: Option<u64>,
    #[command(flatten)]
    pub disk: DiskOptions,
}

/// virtio-rng's own arguments.
#[allow(missing_docs)]
#[derive(Args, Debug, Clone, PartialEq)]
pub struct VirtioRngOwn {
    /// Give the bytes of a seeded generator (SplitMix64) instead of the operating system's:
    /// the same seed gives the same bytes (for tests), never use it for keys.
    #[arg(long, value_name = "SEED")]
    pub seed: Option<u64>,
}

/// The PCI timer's own arguments.
#[allow(missing_docs)]
#[derive(Args, Debug, Clone, PartialEq)]
pub struct TimerOwn {
    /// Ticks per second at power-on (10 µs to 1 s periods: 1 to 100,000 Hz); a driver may
    /// program another period.
    #[arg(long, value_name = "HZ", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub hz: u32,
}

/// The PCI 16550's own arguments.
#[allow(missing_docs)]
#[derive(Args, Debug, Clone, PartialEq)]
pub struct SerialOwn {
    /// The line's far end on this host: pty (a new pseudo-terminal, its path logged),
    /// socket:PATH (a Unix stream socket to connect to), listen:PATH (one to listen on; the
    /// newest peer wins), file:PATH (what is sent is appended; nothing is received), loopback
    /// (what is sent is received, as through a plug joining TX to RX) or null.
    #[arg(long, value_name = "LINE", default_value = "null", value_parser = parse_line_arg)]
    pub line: outboard_devices::serial_line::LineSpec,
}

fn parse_line_arg(s: &str) -> Result<outboard_devices::serial_line::LineSpec, String> {
    outboard_devices::serial_line::LineSpec::parse(s)
}

/// virtio-net's own arguments.
#[allow(missing_docs)]
#[derive(Args, Debug, Clone, PartialEq)]
pub struct VirtioNetOwn {
    /// The NIC's address (six bytes in hex, colon-separated).
    #[arg(long, value_name = "MAC", value_parser = parse_mac_arg)]
    pub mac: String,
    /// Largest payload a frame carries, in bytes (68 to 9000: above 1500, jumbo frames).
    #[arg(long, value_name = "BYTES", default_value_t = 1500, value_parser = clap::value_parser!(u16).range(68..=9000))]
    pub mtu: u16,
    /// Start with the link down (a configuration interrupt tells the driver when it changes).
    #[arg(long)]
    pub link_down: bool,
    /// The cable: a SOCK_SEQPACKET socket inherited as descriptor N, one frame a message,
    /// whose other end is another NIC (what the manager passes). Without it the NIC has no
    /// cable and its link is down.
    #[arg(long, value_name = "fd:N")]
    pub wire: Option<String>,
    /// The cable is a UNIX stream socket speaking QEMU's `-netdev stream` framing (a 4-byte
    /// big-endian length before each frame): connect to a QEMU VM's
    /// `-netdev stream,server=on,addr.type=unix,addr.path=PATH` at start (each start connects
    /// anew).
    #[arg(long, value_name = "PATH", conflicts_with = "wire")]
    pub stream: Option<std::path::PathBuf>,
    /// The cable is a host TAP interface: the host's network stack is at its other end.
    /// `fd:N`: a TAP descriptor inherited as N (what the manager passes: the interface then
    /// outlives the model); or an interface name, made at start and gone when the model ends
    /// (needs CAP_NET_ADMIN).
    #[arg(long, value_name = "fd:N|IFNAME", conflicts_with_all = ["wire", "stream"])]
    pub tap: Option<String>,
    /// The cable is plugged in from the other end: listen on a UNIX stream socket (a path,
    /// bound at start; or `fd:N`, a listening socket inherited, what the manager passes) for a
    /// QEMU VM's `-netdev stream,server=off,addr.type=unix,addr.path=PATH` (QEMU's framing).
    /// The link is down until a peer connects, and again when it goes, until the next.
    #[arg(long, value_name = "PATH|fd:N", conflicts_with_all = ["wire", "stream", "tap"])]
    pub stream_listen: Option<String>,
}

/// A MAC address on the command line (`02:00:00:00:00:01`).
pub fn parse_mac_arg(s: &str) -> Result<String, String> {
    parse_mac(s).map(|_| s.to_string())
}

/// A NIC's own address's six bytes (`02:00:00:00:00:01`): not a group address.
pub fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let mac = parse_address(s)?;
    if mac[0] & 1 != 0 {
        return Err(format!(
            "{s:?} is a multicast address: a NIC's own address is not"
        ));
    }
    Ok(mac)
}

/// Any Ethernet address's six bytes (a station, a group, broadcast).
pub fn parse_address(s: &str) -> Result<[u8; 6], String> {
    let parts: Vec<&str> = s.split(':').collect();
    let mut mac = [0u8; 6];
    if parts.len() != 6 {
        return Err(format!(
            "{s:?} is not a MAC address (six hex bytes, e.g. 02:00:00:00:00:01)"
        ));
    }
    for (b, p) in mac.iter_mut().zip(&parts) {
        *b = u8::from_str_radix(p, 16)
            .ok()
            .filter(|_| p.len() == 2)
            .ok_or_else(|| {
                format!("{s:?} is not a MAC address (six hex bytes, e.g. 02:00:00:00:00:01)")
            })?;
    }
    Ok(mac)
}

/// A size on the command line (4096, 64M, 2G).
pub fn parse_size_arg(s: &str) -> Result<u64, String> {
    outboard_devices::backing::parse_size(s)
        .ok_or_else(|| format!("{s:?} is not a size (e.g. 4096, 64M, 2G)"))
}

/// A model's own arguments, typed: each is the struct its `outboard device MODEL` parser
/// flattens, so what the manager writes is what the model reads.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelOwn {
    /// `outboard device virtio-blk`.
    VirtioBlk(VirtioBlkOwn),
    /// `outboard device virtio-rng`.
    VirtioRng(VirtioRngOwn),
    /// `outboard device virtio-net`.
    VirtioNet(VirtioNetOwn),
    /// `outboard device timer`.
    Timer(TimerOwn),
    /// `outboard device serial`.
    Serial(SerialOwn),
}

impl ModelOwn {
    /// The model's name, as `outboard device` takes it.
    pub fn model(&self) -> &'static str {
        match self {
            Self::VirtioBlk(_) => "virtio-blk",
            Self::VirtioRng(_) => "virtio-rng",
            Self::VirtioNet(_) => "virtio-net",
            Self::Timer(_) => "timer",
            Self::Serial(_) => "serial",
        }
    }

    fn write(&self, a: &mut Line) {
        match self {
            Self::VirtioBlk(o) => {
                a.opt("--backing", Some(&o.backing));
                a.opt("--create", o.create);
                o.disk.write(a);
            }
            Self::VirtioRng(o) => a.opt("--seed", o.seed),
            Self::Timer(o) => a.opt("--hz", Some(o.hz)),
            Self::Serial(o) => a.opt("--line", Some(&o.line)),
            Self::VirtioNet(o) => {
                a.opt("--mac", Some(&o.mac));
                a.opt("--mtu", (o.mtu != 1500).then_some(o.mtu));
                a.flag("--link-down", o.link_down);
                a.opt("--wire", o.wire.as_ref());
                a.opt("--stream", o.stream.as_ref().map(|p| p.display()));
                a.opt("--tap", o.tap.as_ref());
                a.opt("--stream-listen", o.stream_listen.as_ref());
            }
        }
    }
}

/// A device model as the manager starts it: `outboard device MODEL`, where it listens, its
/// faults, the model's own arguments (from its entry in [`crate::models`]) and its
/// confinement.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelArgs {
    /// Where it listens and reports.
    pub listen: ModelListen,
    /// Its faults.
    pub faults: ModelFaults,
    /// The model, and its own arguments.
    pub own: ModelOwn,
    /// Its confinement.
    pub confine: ConfineArgs,
}

impl ModelArgs {
    /// The command line after the program's name: `device MODEL` and its arguments.
    pub fn command_line(&self) -> Vec<String> {
        let mut a = Line::of(["device", self.own.model()]);
        a.opt("--socket", self.listen.socket.as_ref().map(|p| p.display()));
        a.opt("--fd", self.listen.fd);
        a.opt("--notify-fd", self.listen.notify_fd);
        a.opt(
            "--faults-socket",
            self.faults.faults_socket.as_ref().map(|p| p.display()),
        );
        a.opt("--faults-fd", self.faults.faults_fd);
        a.each("--fault", &self.faults.faults);
        self.own.write(&mut a);
        a.0.extend(self.confine.to_args());
        a.0
    }
}

/// `outboard export tap`: a NIC made a host network interface.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct ExportTapArgs {
    /// NIC name, e.g. nic0.
    pub nic: String,
    /// The interface's name (default: the kernel's next tapN).
    #[arg(long, value_name = "IFNAME", default_value = "")]
    pub name: String,
    /// (internal) The interface, made by the manager, on this inherited descriptor (the
    /// export then needs no privilege to make it, and the interface outlives the export).
    #[arg(long, hide = true, value_name = "FD")]
    pub tap_fd: Option<i32>,
    /// (internal) Ask the manager, and have it connect to the NIC's driver server, on this
    /// inherited connection.
    #[arg(long, hide = true, value_name = "FD")]
    pub broker_fd: Option<i32>,
    /// Take the NIC's receive path: the device writes each frame straight into the export's
    /// buffers (no copy in the driver server). Refused while another session receives on
    /// the NIC; while held, other sessions may send but not receive.
    #[arg(long)]
    pub own: bool,
    /// Serve unconfined: no seccomp filter, no Landlock (debugging only).
    #[arg(long)]
    pub no_confine: bool,
    /// Refuse to serve unless every layer of confinement holds in full.
    #[arg(long, conflicts_with = "no_confine")]
    pub require_confinement: bool,
}

impl ExportTapArgs {
    /// The command line after the program's name: `export tap` and its arguments.
    pub fn command_line(&self) -> Vec<String> {
        let mut a = Line::of(["export", "tap"]);
        a.0.push(self.nic.clone());
        a.opt("--name", Some(&self.name).filter(|n| !n.is_empty()));
        a.opt("--tap-fd", self.tap_fd);
        a.opt("--broker-fd", self.broker_fd);
        a.flag("--own", self.own);
        a.flag("--no-confine", self.no_confine);
        a.flag("--require-confinement", self.require_confinement);
        a.0
    }
}

/// A child's command line as it is written: each flag with its value, written only when it has
/// one, the way the child's parser reads it back.
struct Line(Vec<String>);

impl Line {
    fn of<const N: usize>(words: [&str; N]) -> Self {
        Self(words.iter().map(|w| w.to_string()).collect())
    }

    /// `flag value`, if there is a value.
    fn opt(&mut self, flag: &str, value: Option<impl std::fmt::Display>) {
        if let Some(v) = value {
            self.0.extend([flag.to_string(), v.to_string()]);
        }
    }

    /// `flag value` once per value.
    fn each(&mut self, flag: &str, values: &[impl std::fmt::Display]) {
        for v in values {
            self.opt(flag, Some(v));
        }
    }

    /// `flag`, if it is on.
    fn flag(&mut self, flag: &str, on: bool) {
        if on {
            self.0.push(flag.to_string());
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
        DriverHost(Box<DriverHostArgs>),
        #[command(subcommand)]
        Export(Export),
    }

    #[derive(clap::Subcommand)]
    enum Export {
        Nbd(Box<ExportNbdArgs>),
        Tap(ExportTapArgs),
    }

    fn parse(line: Vec<String>) -> Command {
        let line: Vec<String> = std::iter::once("outboard".to_string())
            .chain(line)
            .collect();
        Cli::try_parse_from(&line)
            .unwrap_or_else(|e| panic!("{line:?}: {e}"))
            .command
    }

    #[test]
    fn a_tap_export_the_manager_describes_parses_back_the_same() {
        for a in [
            ExportTapArgs {
                nic: "nic0".into(),
                name: String::new(),
                tap_fd: None,
                broker_fd: None,
                own: false,
                no_confine: true,
                require_confinement: false,
            },
            ExportTapArgs {
                nic: "nic1".into(),
                name: "ob1".into(),
                tap_fd: Some(3),
                broker_fd: Some(4),
                own: true,
                no_confine: false,
                require_confinement: true,
            },
        ] {
            let Command::Export(Export::Tap(back)) = parse(a.command_line()) else {
                panic!("not a TAP export")
            };
            assert_eq!(back, a);
        }
    }

    #[test]
    fn an_export_the_manager_describes_parses_back_the_same() {
        let plain = ExportNbdArgs::of(vec!["disk0".into()]);
        let Command::Export(Export::Nbd(back)) = parse(plain.command_line()) else {
            panic!("not an export")
        };
        assert_eq!(*back, plain);
        let mut full = ExportNbdArgs::of(vec!["disk0".into()]);
        full.listen = Some("127.0.0.1:10809".parse().unwrap());
        full.name = Some("boot".into());
        full.read_only = true;
        full.tls_cert = Some("/etc/c.pem".into());
        full.tls_key = Some("/etc/k.pem".into());
        full.tls_verify_peer = Some("/etc/ca.pem".into());
        full.max_connections = 7;
        full.handshake_timeout = std::time::Duration::from_millis(2500);
        full.idle_timeout = Some(std::time::Duration::from_secs(60));
        full.write_timeout = std::time::Duration::from_secs(5);
        full.notify_fd = Some(3);
        full.broker_fd = Some(4);
        full.user = Some("65534:65534".parse().unwrap());
        full.require_confinement = true;
        full.max_files = 256;
        full.max_memory = Some(4 << 30);
        let Command::Export(Export::Nbd(back)) = parse(full.command_line()) else {
            panic!("not an export")
        };
        assert_eq!(*back, full);
        let mut psk = ExportNbdArgs::of(vec!["disk0".into(), "disk1".into()]);
        psk.socket = Some("/run/x.nbd".into());
        psk.tls_psk = Some("/etc/keys.psk".into());
        psk.insecure = true;
        psk.no_confine = true;
        let Command::Export(Export::Nbd(back)) = parse(psk.command_line()) else {
            panic!("not an export")
        };
        assert_eq!(*back, psk);
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
        a.driver_abort_on = vec!["disk0=8192".into()];
        a.notify_fd = Some(3);
        a.deadline_ms = 1500;
        a.restartable = true;
        a.resume_grace_ms = 250;
        a.isolate_ms = 2000;
        a.quarantine = vec!["77:100000008:800".parse().unwrap()];
        a.hold_back = vec!["78:200000008:10".parse().unwrap()];
        a.set_quiesced("disk0", true);
        let line: Vec<String> = std::iter::once("outboard".to_string())
            .chain(a.command_line())
            .collect();
        let Command::DriverHost(back) = Cli::try_parse_from(&line).unwrap().command else {
            panic!("not a driver server")
        };
        assert_eq!(*back, a, "{line:?}");
        // And the defaults: a server as plain as the command line makes it.
        let plain = DriverHostArgs::on_fd(4, ConfineArgs::default());
        let mut minimal = vec![
            "outboard".to_string(),
            "driver-host".into(),
            "--listen-fd".into(),
            "4".into(),
        ];
        minimal.extend(["--device".into(), "x=null:4096".into()]);
        let Command::DriverHost(parsed) = Cli::try_parse_from(&minimal).unwrap().command else {
            panic!("not a driver server")
        };
        let mut expected = plain;
        expected.devices = vec!["x=null:4096".into()];
        assert_eq!(*parsed, expected);
    }
}
