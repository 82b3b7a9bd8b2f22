//! `--confine` and `--check-confinement` for the roles that touch devices: driver servers and
//! device models.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

#[derive(Args, Debug, Clone)]
pub struct ConfineArgs {
    /// Once started, drop every privilege serving does not need: a seccomp allow-list, Landlock
    /// with no filesystem and no network, no_new_privs, resource limits (what `outboard up`
    /// starts its children with). The process then opens nothing new.
    #[arg(long)]
    confine: bool,
    /// Confine, then try what a compromised driver would (open FILE, connect to SOCKET, create
    /// sockets, ptrace and signal process PID, stat by path, FIFREEZE/FS_IOC_SETFLAGS/
    /// SIOCSIFFLAGS/TIOCSTI ioctls and F_SETOWN/F_SETSIG/F_SETLEASE/F_NOTIFY fcntls on fd -1,
    /// start a process, execve, map executable memory) and print each result instead of
    /// serving. Exits 0 if every attempt was
    /// refused, 1 if any worked.
    #[arg(long, num_args = 3, value_names = ["FILE", "SOCKET", "PID"])]
    check_confinement: Option<Vec<String>>,
    /// With --confine: run as this user (a name from /etc/passwd, or UID:GID) once started.
    /// Capabilities are dropped either way.
    #[arg(long, value_name = "USER")]
    user: Option<outboard_confine::privileges::User>,
    /// With --confine: refuse to serve unless every layer holds in full (Landlock enforced
    /// on every thread, not only partly, as on kernels older than the ruleset).
    #[arg(long)]
    require_confinement: bool,
    /// With --confine: most descriptors it may hold (RLIMIT_NOFILE, at most 4096).
    #[arg(long, value_name = "N", default_value_t = outboard_confine::limits::MAX_FILES)]
    max_files: u64,
    /// With --confine: most bytes of address space it may map (RLIMIT_AS), e.g. 4G
    /// [default: unlimited; `outboard up` gives 16G unless the machine says otherwise].
    #[arg(long, value_name = "SIZE", value_parser = |s: &str| outboard_devices::backing::parse_size(s).ok_or("a size, e.g. 4G"))]
    max_memory: Option<u64>,
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
