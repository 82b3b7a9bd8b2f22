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
}

/// The allow-list, by name, number and condition.
pub fn allow_list() -> Vec<(&'static str, i64, Allow)> {
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
        SYS_fstat,
        SYS_newfstatat,
        SYS_statx,
        SYS_close,
        SYS_dup,
        SYS_dup3,
        SYS_fcntl,
        // VFIO's interface is ioctls on the device, group and container fds it was given.
        SYS_ioctl,
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
    v
}

impl Allow {
    fn rules(self) -> Result<Vec<SeccompRule>, seccompiler::BackendError> {
        let cond = match self {
            Allow::Always => return Ok(Vec::new()),
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

/// Builds the filter for this architecture.
pub fn program() -> Result<BpfProgram, ConfineError> {
    let err = |e: &dyn std::fmt::Display| ConfineError::Seccomp(e.to_string());
    let mut rules = BTreeMap::new();
    for (_, nr, allow) in allow_list() {
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
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| err(&e))
}

/// Loads the filter on every thread of the process; returns how many calls it allows.
/// Needs `no_new_privs` (set by [`crate::limits::apply`]).
pub fn install() -> Result<usize, ConfineError> {
    let prog = program()?;
    seccompiler::apply_filter_all_threads(&prog)
        .map_err(|e| ConfineError::Seccomp(e.to_string()))?;
    Ok(allow_list().len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_has_no_duplicates_and_none_of_the_dangerous_calls() {
        let list = allow_list();
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
        ] {
            assert!(
                list.iter().all(|(_, nr, _)| *nr != bad),
                "system call {bad} must not be allowed"
            );
        }
    }

    #[test]
    fn the_filter_compiles_for_this_machine() {
        let prog = program().unwrap();
        assert!(prog.len() > allow_list().len());
    }
}
