//! The handshake: fixed newstyle negotiation, from the greeting to the export the client
//! chose (or its leaving). Every option is parsed and checked; a malformed one gets the
//! protocol's error reply and negotiation goes on; a broken stream (bad magic, an option too
//! long to skip, unknown client flags) ends this connection only.

use std::io::{Read, Write};

use crate::proto::{self, client_flags, info, opt, rep, InfoRequest, OptionHeader};
use crate::NbdError;

/// Most options one negotiation may send before the server gives up on it.
const MAX_OPTIONS: usize = 1024;

/// What the server offers under one name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Export {
    /// The name clients ask for (`NBD_OPT_GO`); the first export is also the default ("").
    pub name: String,
    /// For humans (`nbdinfo --list`).
    pub description: String,
    /// Size in bytes.
    pub size: u64,
    /// The device's block size: the smallest request, and every request's alignment.
    pub block_size: u32,
    /// Largest request payload.
    pub max_payload: u32,
    /// Writes are refused.
    pub read_only: bool,
    /// Several connections may be open at once with one consistent view.
    pub multi_conn: bool,
}

impl Export {
    /// The transmission flags sent with the size.
    pub fn transmission_flags(&self) -> u16 {
        use proto::flags::*;
        let mut f = HAS_FLAGS | SEND_FLUSH | SEND_FUA | SEND_CACHE;
        if self.read_only {
            f |= READ_ONLY;
        } else {
            f |= SEND_TRIM | SEND_WRITE_ZEROES;
        }
        if self.multi_conn {
            f |= CAN_MULTI_CONN;
        }
        f
    }

    /// Preferred request size: a page, or the block if larger.
    pub fn preferred(&self) -> u32 {
        self.block_size.max(4096)
    }
}

/// Where a negotiation stands on TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TlsPolicy {
    /// The server can start TLS (`NBD_OPT_STARTTLS`).
    pub available: bool,
    /// It must, before anything but `NBD_OPT_ABORT`.
    pub required: bool,
    /// TLS is running: negotiation goes on inside it (no greeting again).
    pub active: bool,
}

/// How the negotiation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The client asked for TLS and was told yes: run the handshake on the stream, then
    /// negotiate again with `TlsPolicy::active` (options chosen before are forgotten).
    StartTls {
        /// The client's flags asked for no zeroes.
        no_zeroes: bool,
    },
    /// Transmission begins on export `export` (an index into the list).
    Go {
        /// Which export.
        export: usize,
        /// Structured replies were negotiated.
        structured: bool,
    },
    /// The client aborted or left before choosing.
    Ended,
}

fn read_exact<S: Read>(s: &mut S, buf: &mut [u8]) -> Result<bool, NbdError> {
    match s.read_exact(buf) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(NbdError::Io(e.to_string())),
    }
}

fn send<S: Write>(s: &mut S, bytes: &[u8]) -> Result<(), NbdError> {
    s.write_all(bytes).map_err(|e| NbdError::Io(e.to_string()))
}

fn find<'a>(exports: &'a [Export], name: &str) -> Option<(usize, &'a Export)> {
    if name.is_empty() {
        return exports.first().map(|e| (0, e));
    }
    exports.iter().enumerate().find(|(_, e)| e.name == name)
}

/// Runs the handshake on `s` for `exports`, without TLS.
pub fn negotiate<S: Read + Write>(s: &mut S, exports: &[Export]) -> Result<Outcome, NbdError> {
    negotiate_with(s, exports, &mut |_| Ok(()), TlsPolicy::default(), false)
}

/// As [`negotiate`]; `choose` is called with the export a client picked, before it is told
/// yes, and may refuse it with a reason (the device is busy or failed). `tls` says whether TLS
/// may or must be started, or is running (then `no_zeroes` carries the client's flag from
/// before it, and there is no greeting).
pub fn negotiate_with<S: Read + Write>(
    s: &mut S,
    exports: &[Export],
    choose: &mut dyn FnMut(usize) -> Result<(), String>,
    tls: TlsPolicy,
    no_zeroes: bool,
) -> Result<Outcome, NbdError> {
    let no_zeroes = if tls.active {
        no_zeroes
    } else {
        send(s, &proto::greeting())?;
        let mut flags = [0u8; 4];
        if !read_exact(s, &mut flags)? {
            return Ok(Outcome::Ended);
        }
        let flags = u32::from_be_bytes(flags);
        if flags & !(client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES) != 0 {
            return Err(NbdError::Protocol(format!(
                "unknown client flags {flags:#x}"
            )));
        }
        flags & client_flags::NO_ZEROES != 0
    };
    let tls_pending = tls.required && !tls.active;
    let mut structured = false;
    for _ in 0..MAX_OPTIONS {
        let mut h = [0u8; OptionHeader::SIZE];
        if !read_exact(s, &mut h)? {
            return Ok(Outcome::Ended);
        }
        let h = OptionHeader::parse(&h).map_err(|e| NbdError::Protocol(e.to_string()))?;
        if h.length > proto::MAX_OPTION {
            // Skipping gigabytes to stay in step is not worth it: say why, and end.
            let why = format!("option data of {} bytes is too long", h.length);
            send(
                s,
                &proto::option_reply(h.option, rep::ERR_TOO_BIG, why.as_bytes()),
            )?;
            return Err(NbdError::Protocol(why));
        }
        let mut data = vec![0u8; h.length as usize];
        if !read_exact(s, &mut data)? {
            return Ok(Outcome::Ended);
        }
        let reply =
            |s: &mut S, kind: u32, d: &[u8]| send(s, &proto::option_reply(h.option, kind, d));
        let refuse = |s: &mut S, kind: u32, why: &str| reply(s, kind, why.as_bytes());
        if tls_pending && !matches!(h.option, opt::STARTTLS | opt::ABORT) {
            if h.option == opt::EXPORT_NAME {
                return Err(NbdError::Protocol(
                    "NBD_OPT_EXPORT_NAME before the TLS this export requires".into(),
                ));
            }
            refuse(
                s,
                rep::ERR_TLS_REQD,
                "this export requires TLS: NBD_OPT_STARTTLS first",
            )?;
            continue;
        }
        match h.option {
            opt::EXPORT_NAME => {
                let name =
                    proto::export_name(&data).map_err(|e| NbdError::Protocol(e.to_string()))?;
                // No error reply is possible here: an unknown name ends the connection.
                let Some((i, e)) = find(exports, &name) else {
                    return Err(NbdError::Protocol(format!("no export named {name:?}")));
                };
                choose(i).map_err(NbdError::Setup)?;
                let mut b = e.size.to_be_bytes().to_vec();
                b.extend_from_slice(&e.transmission_flags().to_be_bytes());
                if !no_zeroes {
                    b.extend_from_slice(&[0u8; 124]);
                }
                send(s, &b)?;
                return Ok(Outcome::Go {
                    export: i,
                    structured,
                });
            }
            opt::ABORT => {
                let _ = reply(s, rep::ACK, &[]);
                return Ok(Outcome::Ended);
            }
            opt::LIST => {
                if !data.is_empty() {
                    refuse(s, rep::ERR_INVALID, "NBD_OPT_LIST carries no data")?;
                    continue;
                }
                for e in exports {
                    reply(s, rep::SERVER, &proto::rep_server(&e.name))?;
                }
                reply(s, rep::ACK, &[])?;
            }
            opt::STARTTLS if !tls.available => {
                refuse(s, rep::ERR_POLICY, "TLS is not configured on this export")?
            }
            opt::STARTTLS if tls.active => refuse(s, rep::ERR_INVALID, "TLS is already on")?,
            opt::STARTTLS if !data.is_empty() => {
                refuse(s, rep::ERR_INVALID, "NBD_OPT_STARTTLS carries no data")?
            }
            opt::STARTTLS => {
                reply(s, rep::ACK, &[])?;
                return Ok(Outcome::StartTls { no_zeroes });
            }
            opt::INFO | opt::GO => {
                let r = match InfoRequest::parse(&data) {
                    Ok(r) => r,
                    Err(e) => {
                        refuse(s, rep::ERR_INVALID, &e.to_string())?;
                        continue;
                    }
                };
                let Some((i, e)) = find(exports, &r.name) else {
                    refuse(
                        s,
                        rep::ERR_UNKNOWN,
                        &format!("no export named {:?}", r.name),
                    )?;
                    continue;
                };
                let asked = |t: u16| r.requests.contains(&t);
                if e.block_size > 512 && !asked(info::BLOCK_SIZE) {
                    refuse(
                        s,
                        rep::ERR_BLOCK_SIZE_REQD,
                        &format!(
                            "this export has {}-byte blocks: ask for NBD_INFO_BLOCK_SIZE and \
                             align requests to it",
                            e.block_size
                        ),
                    )?;
                    continue;
                }
                if h.option == opt::GO {
                    if let Err(why) = choose(i) {
                        refuse(s, rep::ERR_POLICY, &why)?;
                        continue;
                    }
                }
                reply(
                    s,
                    rep::INFO,
                    &proto::info_export(e.size, e.transmission_flags()),
                )?;
                if asked(info::NAME) {
                    reply(s, rep::INFO, &proto::info_string(info::NAME, &e.name))?;
                }
                if asked(info::DESCRIPTION) {
                    reply(
                        s,
                        rep::INFO,
                        &proto::info_string(info::DESCRIPTION, &e.description),
                    )?;
                }
                if asked(info::BLOCK_SIZE) {
                    let b = proto::info_block_size(e.block_size, e.preferred(), e.max_payload);
                    reply(s, rep::INFO, &b)?;
                }
                reply(s, rep::ACK, &[])?;
                if h.option == opt::GO {
                    return Ok(Outcome::Go {
                        export: i,
                        structured,
                    });
                }
            }
            opt::STRUCTURED_REPLY => {
                if !data.is_empty() {
                    refuse(
                        s,
                        rep::ERR_INVALID,
                        "NBD_OPT_STRUCTURED_REPLY carries no data",
                    )?;
                    continue;
                }
                structured = true;
                reply(s, rep::ACK, &[])?;
            }
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
                if !structured {
                    refuse(
                        s,
                        rep::ERR_INVALID,
                        "metadata contexts need structured replies",
                    )?;
                    continue;
                }
                // No metadata context is offered: none is listed, none is selected.
                reply(s, rep::ACK, &[])?;
            }
            other => refuse(
                s,
                rep::ERR_UNSUP,
                &format!("option {other} is not supported"),
            )?,
        }
    }
    Err(NbdError::Protocol(format!(
        "more than {MAX_OPTIONS} options without choosing an export"
    )))
}
