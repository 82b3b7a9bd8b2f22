//! The seccomp allow-list: the system calls a driver server or a device model makes once it
//! has started, and nothing else. Anything not listed fails with `EPERM`.
//!
//! What is deliberately absent: every way to reach a new object by name (`open*`, `creat`,
//! `mknod*`, `socket`, `connect`, `bind`, `listen`; `stat` by path is the exception),
//! every way to start code (`clone*`, `fork`, `execve*`), every way to reach another process
//! (`ptrace`, `process_vm_*`, `kill`, `pidfd_*`, signals except to itself), and kernel
//! surfaces a driver has no use for (`bpf`, `io_uring_*`, `keyctl`, `perf_event_open`,
//! `userfaultfd`, `mount`, `setns`, `unshare`, `prctl`, `setrlimit`, …).

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

use crate::ConfineError;

/// What a listed system call may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allow {
    /// Any arguments.
    Always,
    /// Argument `n` (a protection) must not ask for `PROT_EXEC`: no new code.
    NoExec(u8),
    /// Argument 0 must be this process: signals only to itself (`abort`).
    OwnProcess,
    /// Argument 1 (an `ioctl` request or an `fcntl` command) must be one of these.
    OneOf(&'static [(&'static str, u32)]),
    /// Argument `n` must be one of these (a socket's domain, a `prctl` option).
    ArgOneOf(u8, &'static [(&'static str, u32)]),
    /// Argument `n` (flags) must have every bit of this mask set (`clone` of a thread).
    AllSet(u8, &'static str, u32),
}

/// Which process is confined: it decides the `ioctl` requests it keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A device model: its disk, sockets and memory areas need no `ioctl` at all beyond the
    /// descriptor-flag ones.
    DeviceModel,
    /// A driver server; `vfio` if it drives a PCI function through VFIO (DMA mapping and
    /// device reset stay ioctls on the container and device it holds).
    DriverServer {
        /// Any of its devices is a VFIO device.
        vfio: bool,
    },
    /// An NBD export (`outboard export nbd`): the driver role's list, plus what it needs to
    /// serve clients as they come — a thread per connection (`clone` with `CLONE_THREAD`
    /// only; `clone3`, whose flags a filter cannot read, answers `ENOSYS` so the C library
    /// falls back to `clone`) and naming its threads (`prctl(PR_SET_NAME)` only).
    Export {
        /// It opens sessions with driver servers and asks the manager itself (an export
        /// started by hand): UNIX sockets (`socket` of `AF_UNIX` only, `connect`). One the
        /// manager started gets its connections from the manager and may connect nowhere.
        dials: bool,
    },
}

impl Role {
    /// Whether the role starts threads once confined (so `clone3` must fail with `ENOSYS`,
    /// not `EPERM`, for the C library to use `clone`).
    pub fn starts_threads(self) -> bool {
        matches!(self, Role::Export { .. })
    }
}

/// `AF_UNIX`: the only socket domain an export may create.
const DOMAINS_EXPORT: &[(&str, u32)] = &[("AF_UNIX", libc::AF_UNIX as u32)];

/// `PR_SET_NAME`: the C library and std name threads with it; nothing else of `prctl`.
const PRCTLS_EXPORT: &[(&str, u32)] = &[("PR_SET_NAME", libc::PR_SET_NAME as u32)];

/// `prctl` while confined early: naming threads, and `PR_SET_NO_NEW_PRIVS` (set already; the
/// finish's loader sets it again before it loads its filter, and it can only restrict).
const PRCTLS_EARLY: &[(&str, u32)] = &[
    ("PR_SET_NAME", libc::PR_SET_NAME as u32),
    ("PR_SET_NO_NEW_PRIVS", libc::PR_SET_NO_NEW_PRIVS as u32),
];

/// Process id 0 in `prlimit64`: the calling process itself.
const ITSELF: &[(&str, u32)] = &[("0 (itself)", 0)];

/// What a process confined early — before it opens its device and starts its drivers, so that
/// confining costs nothing once it serves (a standby driver server) — may still do until it
/// finishes: start threads (a driver may start one as it starts; `clone` of a thread only, and
/// `clone3` answers `ENOSYS` as for a role that starts threads), name them (`prctl`), lower its own
/// limits (`RLIMIT_NPROC` goes to 0 only at the finish, since threads count against it) and
/// load the finish's filter.
/// [`install_finish`] takes exactly these away again, so that once finished the process is
/// held by its role's list and nothing more.
pub fn early_extras() -> Vec<(&'static str, i64, Allow)> {
    vec![
        (
            "SYS_clone",
            libc::SYS_clone,
            Allow::AllSet(0, "CLONE_THREAD", libc::CLONE_THREAD as u32),
        ),
        (
            "SYS_prctl",
            libc::SYS_prctl,
            Allow::ArgOneOf(0, PRCTLS_EARLY),
        ),
        (
            "SYS_prlimit64",
            libc::SYS_prlimit64,
            Allow::ArgOneOf(0, ITSELF),
        ),
        ("SYS_setrlimit", libc::SYS_setrlimit, Allow::Always),
        ("SYS_getrlimit", libc::SYS_getrlimit, Allow::Always),
        // The finish's own filter: a filter can only ever be added, never loosened.
        ("SYS_seccomp", libc::SYS_seccomp, Allow::Always),
    ]
}

/// `ioctl` requests every confined process keeps: descriptor flags (std sets non-blocking and
/// close-on-exec with these) and `TCGETS`, which only reads a terminal's settings (a log that
/// asks whether it writes to a terminal). Neither reaches beyond the descriptor.
pub const IOCTLS_COMMON: &[(&str, u32)] = &[
    ("FIONBIO", 0x5421),
    ("FIOCLEX", 0x5451),
    ("FIONCLEX", 0x5450),
    ("TCGETS", 0x5401),
];

/// The VFIO requests a confined driver server still makes, on the container and device
/// descriptors it opened before confinement: map and unmap a session's buffers for DMA, and
/// reset a device that stalled. Set-up (groups, regions, interrupts) happened before.
pub const IOCTLS_VFIO: &[(&str, u32)] = &[
    ("VFIO_IOMMU_MAP_DMA", 0x3b71),
    ("VFIO_IOMMU_UNMAP_DMA", 0x3b72),
    ("VFIO_DEVICE_RESET", 0x3b6f),
];

/// The `fcntl` commands a confined process may use: descriptor and status flags, duplicating
/// with close-on-exec, and memfd seals. Not `F_SETOWN`/`F_SETOWN_EX`/`F_SETSIG` (signals to
/// another process), `F_SETLEASE`, `F_NOTIFY`, locks or pipe sizes.
pub const FCNTLS: &[(&str, u32)] = &[
    ("F_GETFD", libc::F_GETFD as u32),
    ("F_SETFD", libc::F_SETFD as u32),
    ("F_GETFL", libc::F_GETFL as u32),
    ("F_SETFL", libc::F_SETFL as u32),
    ("F_DUPFD_CLOEXEC", libc::F_DUPFD_CLOEXEC as u32),
    ("F_ADD_SEALS", libc::F_ADD_SEALS as u32),
    ("F_GET_SEALS", libc::F_GET_SEALS as u32),
];

/// The `ioctl` requests `role` keeps.
pub fn ioctls(role: Role) -> &'static [(&'static str, u32)] {
    // One static list per role, so that `Allow` stays `Copy` and borrows nothing.
    const COMMON_AND_VFIO: &[(&str, u32)] = &[
        ("FIONBIO", 0x5421),
        ("FIOCLEX", 0x5451),
        ("FIONCLEX", 0x5450),
        ("TCGETS", 0x5401),
        ("VFIO_IOMMU_MAP_DMA", 0x3b71),
        ("VFIO_IOMMU_UNMAP_DMA", 0x3b72),
        ("VFIO_DEVICE_RESET", 0x3b6f),
    ];
    match role {
        Role::DriverServer { vfio: true } => COMMON_AND_VFIO,
        _ => IOCTLS_COMMON,
    }
}

/// The allow-list for `role`, by name, number and condition.
pub fn allow_list(role: Role) -> Vec<(&'static str, i64, Allow)> {
    use Allow::*;
    macro_rules! allow {
        () => {
            Always
        };
        ($cond:expr) => {
            $cond
        };
    }
    macro_rules! list {
        ($($name:ident $(: $cond:expr)?),* $(,)?) => {
            vec![$((stringify!($name), libc::$name, allow!($($cond)?))),*]
        };
    }
    #[allow(unused_mut)]
    let mut v = list![
        // Memory: the allocator, DMA and shared-ring mappings; never executable.
        SYS_brk,
        SYS_mmap: NoExec(2),
        SYS_mprotect: NoExec(2),
        SYS_munmap,
        SYS_mremap,
        SYS_madvise,
        SYS_msync,
        // Descriptors it already holds: its device, its sessions, its backing.
        SYS_read,
        SYS_write,
        SYS_readv,
        SYS_writev,
        SYS_pread64,
        SYS_pwrite64,
        SYS_preadv,
        SYS_pwritev,
        SYS_preadv2,
        SYS_pwritev2,
        SYS_lseek,
        SYS_fsync,
        SYS_fdatasync,
        SYS_fallocate,
        SYS_ftruncate,
        // `fstat` of what it holds; no `stat` by path (`newfstatat`, `statx`): nothing it
        // serves needs to learn what exists where.
        SYS_fstat,
        SYS_close,
        SYS_dup,
        SYS_dup3,
        SYS_fcntl: OneOf(FCNTLS),
        // Only the requests its role needs, each named above.
        SYS_ioctl: OneOf(ioctls(role)),
        // Sessions: accepting on its own listener, messages with descriptors attached.
        SYS_accept4,
        SYS_recvmsg,
        SYS_sendmsg,
        SYS_recvfrom,
        SYS_sendto,
        SYS_shutdown,
        SYS_getsockopt,
        SYS_setsockopt,
        SYS_getsockname,
        SYS_getpeername,
        // A connected pair reaches nothing outside: vfio-user's twin socket is one.
        SYS_socketpair,
        // Memory areas, doorbells and timers it makes for sessions.
        SYS_memfd_create,
        SYS_eventfd2,
        SYS_timerfd_create,
        SYS_timerfd_settime,
        SYS_timerfd_gettime,
        // Waiting.
        SYS_epoll_create1,
        SYS_epoll_ctl,
        SYS_epoll_pwait,
        SYS_epoll_pwait2,
        SYS_ppoll,
        SYS_futex,
        SYS_sched_yield,
        SYS_sched_getaffinity,
        SYS_nanosleep,
        SYS_clock_nanosleep,
        SYS_clock_gettime,
        SYS_clock_getres,
        SYS_gettimeofday,
        // Itself.
        SYS_getpid,
        SYS_gettid,
        SYS_getppid,
        SYS_getrandom,
        SYS_tgkill: OwnProcess,
        SYS_rt_sigaction,
        SYS_rt_sigprocmask,
        SYS_rt_sigreturn,
        SYS_sigaltstack,
        SYS_restart_syscall,
        SYS_rseq,
        SYS_set_robust_list,
        SYS_exit,
        SYS_exit_group,
    ];
    #[cfg(target_arch = "x86_64")]
    v.extend(list![SYS_poll, SYS_epoll_wait, SYS_dup2]);
    if let Role::Export { dials } = role {
        if dials {
            v.extend(list![
                // A session with a driver server, a question to the manager: UNIX sockets
                // only (no TCP or raw socket, no netlink).
                SYS_socket: ArgOneOf(0, DOMAINS_EXPORT),
                SYS_connect,
            ]);
        }
        v.extend(list![
            // A thread per connection, and nothing but threads.
            SYS_clone: AllSet(0, "CLONE_THREAD", libc::CLONE_THREAD as u32),
            SYS_prctl: ArgOneOf(0, PRCTLS_EXPORT),
            // Whom it is: a client checks that a driver server runs as root or as itself.
            SYS_getuid,
            SYS_geteuid,
            SYS_getgid,
            SYS_getegid,
        ]);
    }
    v
}

impl Allow {
    fn rules(self) -> Result<Vec<SeccompRule>, seccompiler::BackendError> {
        let cond = match self {
            Allow::Always => return Ok(Vec::new()),
            // Compared as 32-bit values: the kernel takes both as `unsigned int`, so the
            // upper half of the register cannot smuggle a different request past the filter.
            Allow::OneOf(values) => {
                return values
                    .iter()
                    .map(|&(_, v)| {
                        SeccompRule::new(vec![SeccompCondition::new(
                            1,
                            SeccompCmpArgLen::Dword,
                            SeccompCmpOp::Eq,
                            u64::from(v),
                        )?])
                    })
                    .collect()
            }
            Allow::ArgOneOf(arg, values) => {
                return values
                    .iter()
                    .map(|&(_, v)| {
                        SeccompRule::new(vec![SeccompCondition::new(
                            arg,
                            SeccompCmpArgLen::Dword,
                            SeccompCmpOp::Eq,
                            u64::from(v),
                        )?])
                    })
                    .collect()
            }
            Allow::AllSet(arg, _, mask) => SeccompCondition::new(
                arg,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::MaskedEq(u64::from(mask)),
                u64::from(mask),
            )?,
            Allow::NoExec(arg) => SeccompCondition::new(
                arg,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::MaskedEq(libc::PROT_EXEC as u64),
                0,
            )?,
            Allow::OwnProcess => SeccompCondition::new(
                0,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Eq,
                u64::from(std::process::id()),
            )?,
        };
        Ok(vec![SeccompRule::new(vec![cond])?])
    }
}

/// Builds the filter for `role` on this architecture.
pub fn program(role: Role) -> Result<BpfProgram, ConfineError> {
    program_of(&allow_list(role), role.starts_threads())
}

/// The filter of an early confinement as `role`: its list and [`early_extras`]. Refused for a
/// role whose own list has any of the extras' calls, which the finish could not take away
/// without taking the role's own use of them too.
pub fn early_program(role: Role) -> Result<BpfProgram, ConfineError> {
    let own = allow_list(role);
    let extras = early_extras();
    if let Some((name, _, _)) = extras
        .iter()
        .find(|(_, nr, _)| own.iter().any(|o| o.1 == *nr))
    {
        return Err(ConfineError::Seccomp(format!(
            "{role:?} cannot be confined early: its own list has {name}"
        )));
    }
    let mut list = own;
    list.extend(extras);
    program_of(&list, true)
}

/// The filter that finishes an early confinement: every call of [`early_extras`] (and
/// `clone3`) fails with `EPERM`, anything else is left to the filter installed before. The
/// kernel runs both and keeps the stricter answer, so the two together allow what `role`'s
/// own list allows. A few instructions: installing it costs far less than the whole list.
pub fn finish_program() -> Result<BpfProgram, ConfineError> {
    let err = |e: &dyn std::fmt::Display| ConfineError::Seccomp(e.to_string());
    let mut rules = BTreeMap::new();
    for (_, nr, _) in early_extras() {
        rules.insert(nr, Vec::new());
    }
    rules.insert(libc::SYS_clone3, Vec::new());
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e: seccompiler::BackendError| err(&e))?;
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(|e| err(&e))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| err(&e))
}

fn program_of(
    list: &[(&'static str, i64, Allow)],
    starts_threads: bool,
) -> Result<BpfProgram, ConfineError> {
    let err = |e: &dyn std::fmt::Display| ConfineError::Seccomp(e.to_string());
    let mut rules = BTreeMap::new();
    for &(_, nr, allow) in list {
        rules.insert(nr, allow.rules().map_err(|e| err(&e))?);
    }
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e: seccompiler::BackendError| err(&e))?;
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        arch,
    )
    .map_err(|e| err(&e))?;
    let mut prog: BpfProgram = filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| err(&e))?;
    if starts_threads {
        prog = clone3_unavailable(prog)?;
    }
    Ok(prog)
}

/// `prog` with a prologue that answers `clone3` with `ENOSYS`, as if the kernel had none: its
/// flags sit in a structure a filter cannot read, so it cannot be allowed for threads alone,
/// and on `ENOSYS` (not on `EPERM`) the C library starts a thread with `clone`, whose flags
/// the filter checks. (Chromium's and systemd's policies do the same.) The prologue reads
/// the architecture first, so a call of another ABI falls through to `prog`'s own check.
fn clone3_unavailable(prog: BpfProgram) -> Result<BpfProgram, ConfineError> {
    use seccompiler::sock_filter;
    // From linux/filter.h and linux/seccomp.h: BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K,
    // BPF_RET|BPF_K (BPF_LD, BPF_W and BPF_K are 0).
    const LD_W_ABS: u16 = 0x20;
    const JEQ_K: u16 = 0x05 | 0x10;
    const RET_K: u16 = 0x06;
    const RET_ERRNO: u32 = 0x0005_0000;
    const NR_OFFSET: u32 = 0;
    const ARCH_OFFSET: u32 = 4;
    let arch: u32 = match std::env::consts::ARCH {
        "x86_64" => 62 | 0x8000_0000 | 0x4000_0000,
        "aarch64" => 183 | 0x8000_0000 | 0x4000_0000,
        other => {
            return Err(ConfineError::Seccomp(format!(
                "no clone3 rule for architecture {other}"
            )))
        }
    };
    let at = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    let mut out = vec![
        // 0: A = arch; 1: not ours -> 5 (prog).
        at(LD_W_ABS, 0, 0, ARCH_OFFSET),
        at(JEQ_K, 0, 3, arch),
        // 2: A = nr; 3: not clone3 -> 5 (prog); 4: ENOSYS.
        at(LD_W_ABS, 0, 0, NR_OFFSET),
        at(JEQ_K, 0, 1, libc::SYS_clone3 as u32),
        at(RET_K, 0, 0, RET_ERRNO | libc::ENOSYS as u32),
    ];
    out.extend(prog);
    Ok(out)
}

/// Loads the filter on every thread of the process (`SECCOMP_FILTER_FLAG_TSYNC`: threads
/// started before confinement are filtered too); returns how many calls it allows.
/// Needs `no_new_privs` (set by [`crate::limits::apply`]).
pub fn install(role: Role) -> Result<usize, ConfineError> {
    load(&program(role)?)?;
    Ok(allow_list(role).len())
}

/// Loads [`early_program`] on every thread.
pub fn install_early(role: Role) -> Result<(), ConfineError> {
    load(&early_program(role)?)
}

/// Loads [`finish_program`] on every thread (each already has the early filter: threads
/// started since inherited it); returns how many calls `role`'s list allows, which is now what
/// the process may make.
pub fn install_finish(role: Role) -> Result<usize, ConfineError> {
    load(&finish_program()?)?;
    Ok(allow_list(role).len())
}

fn load(prog: &BpfProgram) -> Result<(), ConfineError> {
    seccompiler::apply_filter_all_threads(prog).map_err(|e| ConfineError::Seccomp(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_early_confinement_adds_only_calls_its_finish_takes_away() {
        for role in [
            Role::DriverServer { vfio: false },
            Role::DriverServer { vfio: true },
            Role::DeviceModel,
        ] {
            let own = allow_list(role);
            for (name, nr, _) in early_extras() {
                assert!(
                    !own.iter().any(|o| o.1 == nr),
                    "{role:?} already has {name}"
                );
            }
            let early = early_program(role).unwrap();
            assert!(early.len() > program(role).unwrap().len(), "{role:?}");
        }
        // An export starts threads on its own list: the finish would take them away from it.
        let e = early_program(Role::Export { dials: false }).unwrap_err();
        assert!(e.to_string().contains("cannot be confined early"), "{e}");
        // The finish is small: what makes it cheap to install on a restart's path.
        let finish = finish_program().unwrap();
        let whole = program(Role::DriverServer { vfio: false }).unwrap();
        assert!(
            finish.len() * 10 < whole.len(),
            "{} vs {}",
            finish.len(),
            whole.len()
        );
    }

    #[test]
    fn the_list_has_no_duplicates_and_none_of_the_dangerous_calls() {
        let list = allow_list(Role::DriverServer { vfio: true });
        let mut names: Vec<_> = list.iter().map(|(n, _, _)| *n).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), list.len(), "a call is listed twice");
        for bad in [
            libc::SYS_openat,
            libc::SYS_openat2,
            libc::SYS_socket,
            libc::SYS_connect,
            libc::SYS_bind,
            libc::SYS_listen,
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_execve,
            libc::SYS_execveat,
            libc::SYS_ptrace,
            libc::SYS_process_vm_readv,
            libc::SYS_process_vm_writev,
            libc::SYS_kill,
            libc::SYS_pidfd_open,
            libc::SYS_prctl,
            libc::SYS_setrlimit,
            libc::SYS_prlimit64,
            libc::SYS_bpf,
            libc::SYS_io_uring_setup,
            libc::SYS_userfaultfd,
            libc::SYS_unshare,
            libc::SYS_setns,
            libc::SYS_mount,
            libc::SYS_newfstatat,
            libc::SYS_statx,
            libc::SYS_tkill,
            libc::SYS_rt_sigqueueinfo,
            libc::SYS_rt_tgsigqueueinfo,
            libc::SYS_pidfd_send_signal,
            libc::SYS_capset,
            libc::SYS_setuid,
            libc::SYS_setresuid,
            libc::SYS_iopl,
            libc::SYS_ioperm,
        ] {
            assert!(
                list.iter().all(|(_, nr, _)| *nr != bad),
                "system call {bad} must not be allowed"
            );
        }
    }

    #[test]
    fn the_export_adds_only_threads_unix_sockets_and_thread_names() {
        let base: Vec<_> = allow_list(Role::DriverServer { vfio: false })
            .into_iter()
            .map(|(n, _, _)| n)
            .collect();
        // The manager's export connects nowhere: the same list without sockets.
        let managed: Vec<_> = allow_list(Role::Export { dials: false })
            .into_iter()
            .map(|(n, _, a)| (n, a))
            .collect();
        let by_hand: Vec<_> = allow_list(Role::Export { dials: true })
            .into_iter()
            .map(|(n, _, a)| (n, a))
            .filter(|(n, _)| !["SYS_socket", "SYS_connect"].contains(n))
            .collect();
        assert_eq!(managed, by_hand);
        let export = allow_list(Role::Export { dials: true });
        let mut names: Vec<_> = export.iter().map(|(n, _, _)| *n).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), export.len(), "a call is listed twice");
        let added: Vec<_> = export
            .iter()
            .filter(|(n, _, _)| !base.contains(n))
            .map(|(n, _, a)| (*n, *a))
            .collect();
        assert_eq!(
            added,
            vec![
                ("SYS_socket", Allow::ArgOneOf(0, DOMAINS_EXPORT)),
                ("SYS_connect", Allow::Always),
                (
                    "SYS_clone",
                    Allow::AllSet(0, "CLONE_THREAD", libc::CLONE_THREAD as u32)
                ),
                ("SYS_prctl", Allow::ArgOneOf(0, PRCTLS_EXPORT)),
                ("SYS_getuid", Allow::Always),
                ("SYS_geteuid", Allow::Always),
                ("SYS_getgid", Allow::Always),
                ("SYS_getegid", Allow::Always),
            ]
        );
        assert!(!names.contains(&"SYS_clone3") && !names.contains(&"SYS_openat"));
        // The prologue answers clone3 before the allow-list is consulted.
        let prog = program(Role::Export { dials: true }).unwrap();
        assert_eq!(prog[3].k, libc::SYS_clone3 as u32);
        assert_eq!(prog[4].k, 0x0005_0000 | libc::ENOSYS as u32);
    }

    #[test]
    fn the_filter_compiles_for_this_machine() {
        for role in [
            Role::DeviceModel,
            Role::DriverServer { vfio: false },
            Role::DriverServer { vfio: true },
            Role::Export { dials: true },
            Role::Export { dials: false },
        ] {
            let prog = program(role).unwrap();
            assert!(prog.len() > allow_list(role).len());
        }
    }

    #[test]
    fn dangerous_ioctls_and_fcntls_are_not_on_any_list() {
        let vfio = ioctls(Role::DriverServer { vfio: true });
        let model = ioctls(Role::DeviceModel);
        assert!(model.iter().all(|(n, _)| !n.starts_with("VFIO")));
        for (name, bad) in [
            ("FIFREEZE", 0xc004_5877u32),
            ("FS_IOC_SETFLAGS", 0x4008_6602),
            ("SIOCSIFFLAGS", 0x8914),
            ("TIOCSTI", 0x5412),
            ("VFIO_GROUP_SET_CONTAINER", 0x3b68),
            ("BLKDISCARD", 0x1277),
        ] {
            assert!(vfio.iter().all(|(_, v)| *v != bad), "{name}");
        }
        for bad in [
            libc::F_SETOWN,
            10, // F_SETSIG
            libc::F_SETLEASE,
            libc::F_NOTIFY,
            libc::F_SETLK,
            libc::F_SETPIPE_SZ,
            libc::F_DUPFD,
        ] {
            assert!(FCNTLS.iter().all(|(_, v)| *v != bad as u32), "fcntl {bad}");
        }
        assert_eq!(&vfio[..IOCTLS_COMMON.len()], IOCTLS_COMMON);
        assert_eq!(&vfio[IOCTLS_COMMON.len()..], IOCTLS_VFIO);
    }
}
