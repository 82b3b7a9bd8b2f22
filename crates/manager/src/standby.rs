//! A standby driver server: started before it is needed — executed, its arguments parsed, its
//! privileges dropped — and waiting for the manager to hand it the place of a server that
//! died. A restart then costs the device's bring-up and the clients' resume, not a fork, an
//! exec and a program's start-up, which were about a third of a restart (`docs/restart.md`).
//!
//! The hand-over is one message on a socket pair only the two hold: the driver server's command
//! line, exactly as the manager would have started it, and its descriptors (the session
//! listener, a fresh connection to each device model), each with the number that command line
//! gives it. The standby puts each descriptor at its number and goes on as the command line
//! says, from the point where a freshly started server has dropped its privileges. A standby
//! whose manager goes away sees its socket close and exits; one that is never needed is killed
//! when its server is removed.
//!
//! A standby for a server that loads no driver library is also confined before it waits
//! (`--confine-early`): Landlock and the whole seccomp allow-list, with threads still allowed
//! until it serves, when a filter of a few instructions takes them away. Confining was a third
//! of a millisecond between a restarted server's "serving" and its first completion. A server
//! that loads a library needs the filesystem and executable mappings to do so, which an early
//! confinement has taken away: its standby confines itself where a fresh server does.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use clap::{Args, Parser};
use serde::{Deserialize, Serialize};

use crate::children::{ConfineArgs, DriverHostArgs};
use crate::supervisor::{Passing, Process, SpawnError, EVENT_FD};

/// Where a standby finds its end of the hand-over socket when it starts (after its event
/// channel).
pub const TAKE_FD: i32 = EVENT_FD + 1;

/// `outboard driver-standby`: what a standby is started with.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct StandbyArgs {
    /// The socket the manager hands a driver server's place over on.
    #[arg(long, value_name = "FD")]
    pub take_fd: i32,
    // How it confines itself before it waits: as the server it will become. (A plain comment:
    // clap would show a doc comment on a flattened group as its heading.)
    #[allow(missing_docs)]
    #[command(flatten)]
    pub confine: ConfineArgs,
    /// Confine itself before it waits, not once it has taken a place and started its
    /// drivers (then it can take only a place that loads no driver library).
    #[arg(long)]
    pub confine_early: bool,
}

impl StandbyArgs {
    /// Its command line, for the CLI's parser to read back.
    pub fn command_line(&self) -> Vec<String> {
        let mut a = vec![
            "driver-standby".to_string(),
            "--take-fd".into(),
            self.take_fd.to_string(),
        ];
        a.extend(self.confine.to_args());
        if self.confine_early {
            a.push("--confine-early".into());
        }
        a
    }
}

/// The hand-over: a driver server's place.
#[derive(Debug, Serialize, Deserialize)]
pub struct TakeOver {
    /// The numbers the descriptors that come with the message go to, in order.
    pub slots: Vec<i32>,
    /// The driver server's command line (`DriverHostArgs::command_line`).
    pub args: Vec<String>,
}

/// The command line a standby is handed, parsed by the same parser `outboard driver-host`
/// uses.
#[derive(Parser)]
struct HandedLine {
    #[command(flatten)]
    args: DriverHostArgs,
}

/// Why a standby could not take a place.
#[derive(Debug, thiserror::Error)]
pub enum StandbyError {
    /// The manager closed the socket: no place will come (it stopped, or dropped this
    /// standby).
    #[error("the manager handed over no place")]
    NotNeeded,
    /// The message or its descriptors could not be taken.
    #[error("hand-over: {0}")]
    HandOver(String),
    /// The command line does not parse, or asks for what a standby cannot be.
    #[error("handed command line: {0}")]
    Line(String),
}

/// Takes the hand-over socket inherited as `take_fd`, moved out of the way of the numbers the
/// hand-over puts descriptors at (to 64 or above). Before the standby lowers its descriptor
/// limit, which may be below that number.
pub fn take_socket(take_fd: i32) -> Result<OwnedFd, StandbyError> {
    outboard_sys::process::inherited_socket_moved(take_fd, 64).map_err(StandbyError::HandOver)
}

/// Waits on `take` ([`take_socket`]), without limit (the manager decides when), for a place;
/// returns the driver server's arguments, with its descriptors put at the numbers they name,
/// and when the hand-over came (`CLOCK_MONOTONIC` ns). A standby drops its privileges before it waits, so the place must
/// be confined as it is (`confine`) and may have no VFIO device (whose server keeps what VFIO
/// needs until it has opened it).
pub fn wait_for_place(
    take: OwnedFd,
    confine: &ConfineArgs,
    confined_early: bool,
) -> Result<(DriverHostArgs, u64), StandbyError> {
    let (msg, fds) = match outboard_session::control::recv::<TakeOver>(take.as_fd(), None) {
        Ok(m) => m,
        Err(outboard_session::SessionError::Closed) => return Err(StandbyError::NotNeeded),
        Err(e) => return Err(StandbyError::HandOver(e.to_string())),
    };
    let taken = outboard_session::control::monotonic_ns();
    let line = HandedLine::try_parse_from(&msg.args)
        .map_err(|e| StandbyError::Line(e.to_string()))?
        .args;
    if line.confine != *confine {
        return Err(StandbyError::Line(
            "confined otherwise than this standby".into(),
        ));
    }
    if !may_serve(&line) {
        return Err(StandbyError::Line(
            "a standby serves no VFIO function and checks no confinement".into(),
        ));
    }
    if confined_early && !may_serve_early(&line) {
        return Err(StandbyError::Line(
            "a standby confined early loads no driver library".into(),
        ));
    }
    outboard_sys::process::place(fds, &msg.slots).map_err(StandbyError::HandOver)?;
    Ok((line, taken))
}

/// Whether a standby may take the place of a server started from `args`: not one with a VFIO
/// function (it keeps privileges a standby has dropped until it has opened it), nor one asked
/// to check its confinement instead of serving.
pub fn may_serve(args: &DriverHostArgs) -> bool {
    !args
        .devices
        .iter()
        .any(|d| d.contains("=vfio:") || d.contains("=vfio-fd:"))
        && args.confine.check_confinement.is_none()
}

/// Whether a standby confined early may take the place of a server started from `args`: one
/// that loads no driver library (which needs files and executable mappings).
pub fn may_serve_early(args: &DriverHostArgs) -> bool {
    args.driver_libs.is_empty()
}

/// A standby as the manager holds it: killed when dropped unless it took a place.
pub struct Standby {
    // Boxed: a process holds its standby, which is a process.
    process: Option<Box<Process>>,
    take: OwnedFd,
    exe: PathBuf,
    confine: ConfineArgs,
    confine_early: bool,
}

impl Standby {
    /// Starts a standby for a server run by `exe` from `server` (its confinement, and whether
    /// the standby may confine itself early: when the server loads no driver library); its
    /// output goes to the end of `log` (its server's).
    pub fn spawn(
        exe: &Path,
        role: &str,
        server: &DriverHostArgs,
        log: PathBuf,
        verbose: u8,
    ) -> Result<Self, SpawnError> {
        let confine = &server.confine;
        let (take, theirs) =
            outboard_session::control::pair().map_err(|e| SpawnError::Descriptor {
                role: role.into(),
                what: "its hand-over socket".into(),
                err: std::io::Error::other(e.to_string()),
            })?;
        let args = StandbyArgs {
            take_fd: TAKE_FD,
            confine: confine.clone(),
            confine_early: may_serve_early(server),
        };
        let passing = Passing {
            events: true,
            keep: vec![theirs],
            ..Passing::default()
        };
        // The child's end is closed here once it is spawned: the standby holds the only one.
        let process =
            Process::spawn_appending(exe, role, &args.command_line(), log, verbose, &passing)?;
        Ok(Self {
            process: Some(Box::new(process)),
            take,
            exe: exe.to_path_buf(),
            confine: confine.clone(),
            confine_early: args.confine_early,
        })
    }

    /// Whether it is still waiting (a standby that died, killed or failing at its start, is
    /// reaped here).
    pub fn alive(&mut self) -> bool {
        self.process
            .as_mut()
            .is_some_and(|p| p.exited.is_none() && !p.reap())
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.process.as_ref().map_or(0, |p| p.pid())
    }

    /// Whether it can take the place of a server that `exe` runs from `args` with `fds`
    /// descriptors: alive, the same program and confinement, no VFIO device, few enough
    /// descriptors for one message.
    pub fn suits(&mut self, exe: &Path, args: &DriverHostArgs, fds: usize) -> bool {
        self.alive()
            && self.exe == exe
            && self.confine == args.confine
            && may_serve(args)
            && (!self.confine_early || may_serve_early(args))
            && fds <= outboard_session::control::MAX_FDS.min(outboard_sys::process::MAX_PASSED)
    }

    /// Hands it the place of a server started from `args`, with `fds` at the numbers given;
    /// returns its process, now that server.
    pub fn take(
        mut self,
        args: &DriverHostArgs,
        fds: &[(i32, BorrowedFd<'_>)],
    ) -> Result<Process, SpawnError> {
        let msg = TakeOver {
            slots: fds.iter().map(|(slot, _)| *slot).collect(),
            args: args.command_line(),
        };
        let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|(_, fd)| *fd).collect();
        let process = self.process.take().expect("held until taken");
        if let Err(e) = outboard_session::control::send(self.take.as_fd(), &msg, &borrowed) {
            self.process = Some(process);
            return Err(SpawnError::Descriptor {
                role: self
                    .process
                    .as_ref()
                    .map_or_else(String::new, |p| p.role.clone()),
                what: "the hand-over".into(),
                err: std::io::Error::other(e.to_string()),
            });
        }
        Ok(*process)
    }
}

impl Drop for Standby {
    fn drop(&mut self) {
        if let Some(p) = self.process.as_mut() {
            // Its own unreaped child: the pid cannot have been reused.
            p.stop(std::time::Duration::ZERO);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unconfined() -> ConfineArgs {
        ConfineArgs::default()
    }

    /// Hands `line` (with one socket at `slot`) to a standby waiting on `take_fd`.
    fn hand(
        take_fd: i32,
        line: &DriverHostArgs,
        slot: i32,
    ) -> Result<(DriverHostArgs, u64), StandbyError> {
        hand_to(take_fd, line, slot, false)
    }

    /// The same, to a standby confined early or not.
    fn hand_to(
        take_fd: i32,
        line: &DriverHostArgs,
        slot: i32,
        early: bool,
    ) -> Result<(DriverHostArgs, u64), StandbyError> {
        let (manager, standby) = outboard_session::control::pair().unwrap();
        outboard_sys::process::place(vec![standby], &[take_fd]).unwrap();
        let (listener, _other) = outboard_session::control::pair().unwrap();
        let msg = TakeOver {
            slots: vec![slot],
            args: line.command_line(),
        };
        outboard_session::control::send(manager.as_fd(), &msg, &[listener.as_fd()]).unwrap();
        wait_for_place(take_socket(take_fd).unwrap(), &unconfined(), early)
    }

    #[test]
    fn a_place_comes_with_its_descriptors_at_their_numbers_and_a_foreign_one_is_refused() {
        let mut line = DriverHostArgs::on_fd(971, unconfined());
        line.devices.push("d=null:1M".into());
        let (got, _) = hand(970, &line, 971).unwrap();
        assert_eq!(got.listen_fd, Some(971));
        assert_eq!(got.devices, line.devices);
        assert!(outboard_sys::process::inherited_socket(971).is_ok());

        // Confined otherwise than the standby: refused before anything is placed.
        let mut other = DriverHostArgs::on_fd(
            973,
            ConfineArgs {
                confine: true,
                ..unconfined()
            },
        );
        other.devices.push("d=null:1M".into());
        let e = hand(972, &other, 973).unwrap_err();
        assert!(e.to_string().contains("confined otherwise"), "{e}");

        // A VFIO function keeps privileges a standby has dropped.
        let mut vfio = DriverHostArgs::on_fd(975, unconfined());
        vfio.devices.push("d=vfio:0000:00:02.0".into());
        let e = hand(974, &vfio, 975).unwrap_err();
        assert!(e.to_string().contains("no VFIO function"), "{e}");
        // Nor one whose container and group the manager passes.
        let mut passed = DriverHostArgs::on_fd(978, unconfined());
        passed.devices.push("d=vfio-fd:5,6:0000:00:02.0".into());
        let e = hand(977, &passed, 978).unwrap_err();
        assert!(e.to_string().contains("no VFIO function"), "{e}");

        // A driver library needs the files and executable mappings an early confinement took
        // away: refused by a standby confined early, taken by one that was not.
        let mut library = DriverHostArgs::on_fd(980, unconfined());
        library.devices.push("d=null:1M".into());
        library.driver_libs.push("/opt/drivers/libtimer.so".into());
        let e = hand_to(979, &library, 980, true).unwrap_err();
        assert!(e.to_string().contains("loads no driver library"), "{e}");
        let mut library = DriverHostArgs::on_fd(982, unconfined());
        library.devices.push("d=null:1M".into());
        library.driver_libs.push("/opt/drivers/libtimer.so".into());
        assert!(hand_to(981, &library, 982, false).is_ok());
        assert!(may_serve_early(&line) && !may_serve_early(&library));
    }

    #[test]
    fn a_standby_whose_manager_closes_the_socket_is_not_needed() {
        let (manager, standby) = outboard_session::control::pair().unwrap();
        outboard_sys::process::place(vec![standby], &[976]).unwrap();
        drop(manager);
        assert!(matches!(
            wait_for_place(take_socket(976).unwrap(), &unconfined(), false),
            Err(StandbyError::NotNeeded)
        ));
    }
}
