//! The NBD wire protocol (the NBD project's `doc/proto.md`), for the export and for the client
//! of remote disks: constants, the parsers of what a
//! client sends, and the encoders of what the server answers. Everything here is pure — bytes
//! in, values or errors out — so it is fuzzed and property-tested without a socket.
//!
//! Every field is big-endian ("network byte order").

/// `NBDMAGIC`: the first eight bytes a server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: newstyle negotiation, and the magic of every option a client sends.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// The magic of every option reply.
pub const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// The magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// The magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// The magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flags the server sends.
pub mod handshake {
    /// Fixed newstyle negotiation.
    pub const FIXED_NEWSTYLE: u16 = 1 << 0;
    /// The 124 bytes of zeroes after `NBD_OPT_EXPORT_NAME` may be left out.
    pub const NO_ZEROES: u16 = 1 << 1;
}

/// Client flags (the client's answer to the handshake flags).
pub mod client_flags {
    /// The client speaks fixed newstyle.
    pub const FIXED_NEWSTYLE: u32 = 1 << 0;
    /// The client does not want the 124 zeroes.
    pub const NO_ZEROES: u32 = 1 << 1;
}

/// Options (`NBD_OPT_*`).
pub mod opt {
    /// Choose an export and end negotiation (old way, no error reply possible).
    pub const EXPORT_NAME: u32 = 1;
    /// End negotiation without an export.
    pub const ABORT: u32 = 2;
    /// List the exports.
    pub const LIST: u32 = 3;
    /// Upgrade to TLS.
    pub const STARTTLS: u32 = 5;
    /// Describe an export.
    pub const INFO: u32 = 6;
    /// Describe an export and choose it.
    pub const GO: u32 = 7;
    /// Use structured replies.
    pub const STRUCTURED_REPLY: u32 = 8;
    /// List metadata contexts.
    pub const LIST_META_CONTEXT: u32 = 9;
    /// Select metadata contexts.
    pub const SET_META_CONTEXT: u32 = 10;
}

/// Option reply types (`NBD_REP_*`).
pub mod rep {
    /// The option is done.
    pub const ACK: u32 = 1;
    /// One export of a list.
    pub const SERVER: u32 = 2;
    /// One piece of information about an export.
    pub const INFO: u32 = 3;
    const ERR: u32 = 1 << 31;
    /// Unknown option.
    pub const ERR_UNSUP: u32 = ERR + 1;
    /// Forbidden by policy.
    pub const ERR_POLICY: u32 = ERR + 2;
    /// Malformed option.
    pub const ERR_INVALID: u32 = ERR + 3;
    /// TLS is required first.
    pub const ERR_TLS_REQD: u32 = ERR + 5;
    /// No such export.
    pub const ERR_UNKNOWN: u32 = ERR + 6;
    /// The server is shutting down.
    pub const ERR_SHUTDOWN: u32 = ERR + 7;
    /// The client must ask for block sizes (and honour them).
    pub const ERR_BLOCK_SIZE_REQD: u32 = ERR + 8;
    /// The option's data is too long.
    pub const ERR_TOO_BIG: u32 = ERR + 9;
}

/// Information types in `NBD_REP_INFO` (`NBD_INFO_*`).
pub mod info {
    /// Size and transmission flags.
    pub const EXPORT: u16 = 0;
    /// The export's canonical name.
    pub const NAME: u16 = 1;
    /// A description for humans.
    pub const DESCRIPTION: u16 = 2;
    /// Minimum, preferred and maximum block sizes.
    pub const BLOCK_SIZE: u16 = 3;
}

/// Transmission flags (`NBD_FLAG_*`), sent with the export's size.
pub mod flags {
    /// Always set: the flags field means something.
    pub const HAS_FLAGS: u16 = 1 << 0;
    /// The export is read-only.
    pub const READ_ONLY: u16 = 1 << 1;
    /// `NBD_CMD_FLUSH` is supported.
    pub const SEND_FLUSH: u16 = 1 << 2;
    /// `NBD_CMD_FLAG_FUA` is supported.
    pub const SEND_FUA: u16 = 1 << 3;
    /// `NBD_CMD_TRIM` is supported.
    pub const SEND_TRIM: u16 = 1 << 5;
    /// `NBD_CMD_WRITE_ZEROES` is supported.
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    /// Several connections see one consistent export; a flush on one covers writes completed on
    /// all of them.
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    /// `NBD_CMD_CACHE` is supported.
    pub const SEND_CACHE: u16 = 1 << 10;
}

/// Commands (`NBD_CMD_*`).
pub mod cmd {
    /// Read.
    pub const READ: u16 = 0;
    /// Write.
    pub const WRITE: u16 = 1;
    /// Disconnect.
    pub const DISC: u16 = 2;
    /// Flush.
    pub const FLUSH: u16 = 3;
    /// Trim (discard).
    pub const TRIM: u16 = 4;
    /// Prefetch into a cache.
    pub const CACHE: u16 = 5;
    /// Write zeroes.
    pub const WRITE_ZEROES: u16 = 6;
}

/// Command flags (`NBD_CMD_FLAG_*`).
pub mod cmd_flags {
    /// Force unit access: durable before the reply.
    pub const FUA: u16 = 1 << 0;
    /// Write zeroes without punching a hole.
    pub const NO_HOLE: u16 = 1 << 1;
    /// Don't fragment a structured read reply.
    pub const DF: u16 = 1 << 2;
    /// Fail write zeroes rather than write slowly.
    pub const FAST_ZERO: u16 = 1 << 4;
}

/// Structured reply chunk types and flags.
pub mod chunk {
    /// The last chunk of a reply.
    pub const FLAG_DONE: u16 = 1 << 0;
    /// No payload: the request succeeded.
    pub const NONE: u16 = 0;
    /// Data at an offset.
    pub const OFFSET_DATA: u16 = 1;
    /// An error, with a message.
    pub const ERROR: u16 = (1 << 15) + 1;
}

/// Error numbers on the wire (Linux values, fixed by the protocol).
pub mod errno {
    /// Operation not permitted (a write to a read-only export).
    pub const EPERM: u32 = 1;
    /// I/O error.
    pub const EIO: u32 = 5;
    /// Out of memory (no buffer for the request).
    pub const ENOMEM: u32 = 12;
    /// Invalid argument.
    pub const EINVAL: u32 = 22;
    /// No space left (a write past the end).
    pub const ENOSPC: u32 = 28;
    /// Value too large (a read too long for one chunk).
    pub const EOVERFLOW: u32 = 75;
    /// Not supported.
    pub const ENOTSUP: u32 = 95;
    /// The server is shutting down.
    pub const ESHUTDOWN: u32 = 108;
}

/// Longest option payload accepted; longer ones are answered `NBD_REP_ERR_TOO_BIG` and skipped.
pub const MAX_OPTION: u32 = 64 << 10;
/// Longest string (export name, message) the protocol allows.
pub const MAX_STRING: usize = 4096;

/// What a client sent that cannot be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// A magic number was wrong: the stream is not NBD (or is out of step).
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
    /// A field is malformed; the message says which.
    #[error("{0}")]
    Malformed(String),
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().expect("4 bytes"))
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().expect("8 bytes"))
}

/// An option header: `IHAVEOPT`, the option, the length of its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// `NBD_OPT_*`.
    pub option: u32,
    /// Bytes of data that follow.
    pub length: u32,
}

impl OptionHeader {
    /// Bytes on the wire.
    pub const SIZE: usize = 16;

    /// Parses the 16 bytes of an option header.
    pub fn parse(b: &[u8; Self::SIZE]) -> Result<Self, ProtoError> {
        let magic = be64(b);
        if magic != IHAVEOPT {
            return Err(ProtoError::BadMagic(magic));
        }
        Ok(Self {
            option: be32(&b[8..]),
            length: be32(&b[12..]),
        })
    }
}

/// A string field: 32-bit length then UTF-8 bytes, within `data` from `at`. Returns the
/// string and where the next field starts.
fn string_at(data: &[u8], at: usize, what: &str) -> Result<(String, usize), ProtoError> {
    let len = data
        .get(at..at + 4)
        .map(be32)
        .ok_or_else(|| ProtoError::Malformed(format!("{what}: no length")))? as usize;
    if len > MAX_STRING {
        return Err(ProtoError::Malformed(format!(
            "{what} of {len} bytes (at most {MAX_STRING})"
        )));
    }
    let bytes = data
        .get(at + 4..at + 4 + len)
        .ok_or_else(|| ProtoError::Malformed(format!("{what} longer than the option")))?;
    let s = std::str::from_utf8(bytes)
        .map_err(|_| ProtoError::Malformed(format!("{what} is not UTF-8")))?;
    if s.contains('\0') {
        return Err(ProtoError::Malformed(format!("{what} contains NUL")));
    }
    Ok((s.to_string(), at + 4 + len))
}

/// The data of `NBD_OPT_INFO` and `NBD_OPT_GO`: an export name and the information the client
/// asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    /// The export (empty: the default one).
    pub name: String,
    /// `NBD_INFO_*` types requested.
    pub requests: Vec<u16>,
}

impl InfoRequest {
    /// Parses the option's data; its length must match exactly.
    pub fn parse(data: &[u8]) -> Result<Self, ProtoError> {
        let (name, at) = string_at(data, 0, "export name")?;
        let n = data
            .get(at..at + 2)
            .map(be16)
            .ok_or_else(|| ProtoError::Malformed("no count of information requests".into()))?
            as usize;
        let list = &data[at + 2..];
        if list.len() != 2 * n {
            return Err(ProtoError::Malformed(format!(
                "{n} information requests in {} bytes",
                list.len()
            )));
        }
        Ok(Self {
            name,
            requests: list.chunks_exact(2).map(be16).collect(),
        })
    }
}

/// The export name of `NBD_OPT_EXPORT_NAME` (the whole data, no length prefix).
pub fn export_name(data: &[u8]) -> Result<String, ProtoError> {
    if data.len() > MAX_STRING {
        return Err(ProtoError::Malformed("export name too long".into()));
    }
    let s = std::str::from_utf8(data)
        .map_err(|_| ProtoError::Malformed("export name is not UTF-8".into()))?;
    if s.contains('\0') {
        return Err(ProtoError::Malformed("export name contains NUL".into()));
    }
    Ok(s.to_string())
}

/// A transmission request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// `NBD_CMD_FLAG_*`.
    pub flags: u16,
    /// `NBD_CMD_*`.
    pub command: u16,
    /// The client's cookie, echoed in the reply.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Byte length (for a write, the payload that follows).
    pub length: u32,
}

impl Request {
    /// Bytes on the wire.
    pub const SIZE: usize = 28;

    /// Parses a request header.
    pub fn parse(b: &[u8; Self::SIZE]) -> Result<Self, ProtoError> {
        let magic = be32(b);
        if magic != REQUEST_MAGIC {
            return Err(ProtoError::BadMagic(magic as u64));
        }
        Ok(Self {
            flags: be16(&b[4..]),
            command: be16(&b[6..]),
            cookie: be64(&b[8..]),
            offset: be64(&b[16..]),
            length: be32(&b[24..]),
        })
    }

    /// Encodes it (for clients and tests).
    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.command.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// The server's greeting: `NBDMAGIC`, `IHAVEOPT`, handshake flags.
pub fn greeting() -> [u8; 18] {
    let mut b = [0u8; 18];
    b[..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[16..].copy_from_slice(&(handshake::FIXED_NEWSTYLE | handshake::NO_ZEROES).to_be_bytes());
    b
}

/// An option reply: header and data.
pub fn option_reply(option: u32, reply: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(20 + data.len());
    b.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&reply.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// `NBD_INFO_EXPORT`: size and transmission flags.
pub fn info_export(size: u64, transmission: u16) -> Vec<u8> {
    let mut b = Vec::with_capacity(12);
    b.extend_from_slice(&info::EXPORT.to_be_bytes());
    b.extend_from_slice(&size.to_be_bytes());
    b.extend_from_slice(&transmission.to_be_bytes());
    b
}

/// `NBD_INFO_BLOCK_SIZE`: minimum, preferred, maximum.
pub fn info_block_size(min: u32, preferred: u32, max: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(14);
    b.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
    for v in [min, preferred, max] {
        b.extend_from_slice(&v.to_be_bytes());
    }
    b
}

/// `NBD_INFO_NAME` or `NBD_INFO_DESCRIPTION`: a string without a length prefix.
pub fn info_string(kind: u16, s: &str) -> Vec<u8> {
    let mut b = kind.to_be_bytes().to_vec();
    b.extend_from_slice(s.as_bytes());
    b
}

/// `NBD_REP_SERVER`: one export of a list.
pub fn rep_server(name: &str) -> Vec<u8> {
    let mut b = (name.len() as u32).to_be_bytes().to_vec();
    b.extend_from_slice(name.as_bytes());
    b
}

/// A simple reply header (a read's data follows it).
pub fn simple_reply(error: u32, cookie: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// A structured reply chunk header; `length` bytes of payload follow.
pub fn chunk_header(flags: u16, kind: u16, cookie: u64, length: u32) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..].copy_from_slice(&length.to_be_bytes());
    b
}

/// A final `NBD_REPLY_TYPE_ERROR` chunk: header and payload (error, message).
pub fn error_chunk(cookie: u64, error: u32, message: &str) -> Vec<u8> {
    let message = &message.as_bytes()[..message.len().min(MAX_STRING)];
    let payload = 6 + message.len();
    let mut b = chunk_header(chunk::FLAG_DONE, chunk::ERROR, cookie, payload as u32).to_vec();
    b.extend_from_slice(&error.to_be_bytes());
    b.extend_from_slice(&(message.len() as u16).to_be_bytes());
    b.extend_from_slice(message);
    b
}

/// A client's option: header and data.
pub fn option(option: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + data.len());
    b.extend_from_slice(&IHAVEOPT.to_be_bytes());
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// An option reply's header, as a client reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReply {
    /// The option it answers.
    pub option: u32,
    /// `NBD_REP_*`.
    pub reply: u32,
    /// Bytes of data that follow.
    pub length: u32,
}

impl OptionReply {
    /// Bytes on the wire.
    pub const SIZE: usize = 20;

    /// Parses an option reply header.
    pub fn parse(b: &[u8; Self::SIZE]) -> Result<Self, ProtoError> {
        let magic = be64(b);
        if magic != REPLY_MAGIC {
            return Err(ProtoError::BadMagic(magic));
        }
        Ok(Self {
            option: be32(&b[8..]),
            reply: be32(&b[12..]),
            length: be32(&b[16..]),
        })
    }
}

/// A simple reply header, as a client reads it: (error, cookie).
pub fn parse_simple_reply(b: &[u8; 16]) -> Result<(u32, u64), ProtoError> {
    let magic = be32(b);
    if magic != SIMPLE_REPLY_MAGIC {
        return Err(ProtoError::BadMagic(magic as u64));
    }
    Ok((be32(&b[4..]), be64(&b[8..])))
}

/// The information a client learns from `NBD_REP_INFO` replies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportInfo {
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags.
    pub flags: u16,
    /// Minimum, preferred and maximum block sizes, if sent.
    pub block_sizes: Option<(u32, u32, u32)>,
}

impl ExportInfo {
    /// Takes in one `NBD_REP_INFO` payload; unknown information types are ignored.
    pub fn absorb(&mut self, data: &[u8]) -> Result<(), ProtoError> {
        let short = || ProtoError::Malformed(format!("information of {} bytes", data.len()));
        let kind = data.get(..2).map(be16).ok_or_else(short)?;
        match kind {
            info::EXPORT if data.len() == 12 => {
                self.size = be64(&data[2..]);
                self.flags = be16(&data[10..]);
            }
            info::BLOCK_SIZE if data.len() == 14 => {
                self.block_sizes = Some((be32(&data[2..]), be32(&data[6..]), be32(&data[10..])));
            }
            info::EXPORT | info::BLOCK_SIZE => return Err(short()),
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn magics_spell_what_the_protocol_says() {
        assert_eq!(&NBD_MAGIC.to_be_bytes(), b"NBDMAGIC");
        assert_eq!(&IHAVEOPT.to_be_bytes(), b"IHAVEOPT");
        assert_eq!(greeting()[16..], [0, 3]);
    }

    #[test]
    fn a_go_request_parses_and_bad_lengths_are_refused() {
        let mut d = 4u32.to_be_bytes().to_vec();
        d.extend_from_slice(b"disk");
        d.extend_from_slice(&2u16.to_be_bytes());
        d.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
        d.extend_from_slice(&info::NAME.to_be_bytes());
        let r = InfoRequest::parse(&d).unwrap();
        assert_eq!(r.name, "disk");
        assert_eq!(r.requests, vec![info::BLOCK_SIZE, info::NAME]);
        // One byte short, one byte long, a name longer than the data.
        assert!(InfoRequest::parse(&d[..d.len() - 1]).is_err());
        let mut long = d.clone();
        long.push(0);
        assert!(InfoRequest::parse(&long).is_err());
        let mut lie = d.clone();
        lie[..4].copy_from_slice(&1000u32.to_be_bytes());
        assert!(InfoRequest::parse(&lie).is_err());
        let mut nul = d;
        nul[5] = 0;
        assert!(InfoRequest::parse(&nul).is_err());
    }

    #[test]
    fn an_error_chunk_carries_its_message_and_length() {
        let c = error_chunk(7, errno::EINVAL, "past the end");
        assert_eq!(be32(&c[..]), STRUCTURED_REPLY_MAGIC);
        assert_eq!(be16(&c[4..]), chunk::FLAG_DONE);
        assert_eq!(be16(&c[6..]), chunk::ERROR);
        assert_eq!(be64(&c[8..]), 7);
        assert_eq!(be32(&c[16..]) as usize, c.len() - 20);
        assert_eq!(be32(&c[20..]), errno::EINVAL);
        assert_eq!(&c[26..], b"past the end");
    }

    proptest! {
        #[test]
        fn requests_round_trip(flags: u16, command: u16, cookie: u64, offset: u64, length: u32) {
            let r = Request { flags, command, cookie, offset, length };
            prop_assert_eq!(Request::parse(&r.encode()).unwrap(), r);
        }

        #[test]
        fn no_input_panics_a_parser(data in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = InfoRequest::parse(&data);
            let _ = export_name(&data);
            if let Ok(b) = <[u8; Request::SIZE]>::try_from(&data[..data.len().min(Request::SIZE)]) {
                let _ = Request::parse(&b);
            }
            if let Ok(b) = <[u8; OptionHeader::SIZE]>::try_from(&data[..data.len().min(OptionHeader::SIZE)]) {
                let _ = OptionHeader::parse(&b);
            }
        }
    }
}
