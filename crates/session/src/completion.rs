//! The completion entry of the [`RingShape::request_reply`](crate::RingShape::request_reply)
//! shape, the same for every class that has it, and the rule for the words behind a failure.
//!
//! Layout (16 bytes, little-endian): the request's tag u64 at 0; its status i32 at 8 (0, or
//! the class's negative code for why it failed); a value u32 at 12 — what a success returns
//! (block and entropy: bytes done), and for a failure [`REASON_SENT`] when the reason went
//! ahead of it on the reasons ring ([`crate::reason`]), else 0.
//!
//! A class says what its codes mean through [`WireError`]; the server core posts a failure's
//! reason before its completion, the client core takes it back, and the class's error comes
//! out whole at the client — code and words.

/// Bytes per completion entry.
pub const COMPLETION_SIZE: u32 = 16;
/// A failed completion's value when its reason went ahead of it.
pub const REASON_SENT: u32 = 1;

/// A class's error as it crosses a completion ring.
pub trait WireError: Sized {
    /// Its code: negative (0 is success), one per kind, stable.
    fn code(&self) -> i32;
    /// The words the code does not carry (what the device said, what the check refused), sent
    /// beside the completion; `None` for a kind the code says all about.
    fn reason(&self) -> Option<&str>;
    /// The error a code stands for, with the reason that came with it if any (an unknown code
    /// reads as a protocol error; a reason for a kind that takes none is dropped).
    fn from_wire(code: i32, reason: Option<String>) -> Self;
}

/// Checks a class's table of error kind names (code `-k`'s at `k - 1`, for counters) against
/// its codes: every name stands for a code the class knows, and the code after the last is
/// not one. For each class's tests.
pub fn check_kind_names<E: WireError>(names: &[&str]) -> Result<(), String> {
    for (k, name) in names.iter().enumerate() {
        let code = -(k as i32) - 1;
        let back = E::from_wire(code, Some("x".into())).code();
        if back != code {
            return Err(format!(
                "{name:?} names code {code}, which reads back as {back}"
            ));
        }
    }
    let beyond = -(names.len() as i32) - 1;
    if E::from_wire(beyond, None).code() == beyond {
        return Err(format!("code {beyond} has no name"));
    }
    Ok(())
}

/// One completion entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The request's tag.
    pub tag: u64,
    /// 0, or the class's negative code.
    pub status: i32,
    /// A success's value; a failure's [`REASON_SENT`] flag.
    pub value: u32,
}

impl Completion {
    /// The entry for request `tag`'s result (a failure's reason not yet sent).
    pub fn of<E: WireError>(tag: u64, result: &Result<u32, E>) -> Self {
        match result {
            Ok(value) => Self {
                tag,
                status: 0,
                value: *value,
            },
            Err(e) => Self {
                tag,
                status: e.code(),
                value: 0,
            },
        }
    }

    /// The entry's bytes.
    pub fn encode(&self) -> [u8; COMPLETION_SIZE as usize] {
        let mut e = [0u8; COMPLETION_SIZE as usize];
        e[..8].copy_from_slice(&self.tag.to_le_bytes());
        e[8..12].copy_from_slice(&self.status.to_le_bytes());
        e[12..].copy_from_slice(&self.value.to_le_bytes());
        e
    }

    /// Reads an entry (any bytes are an entry; what they mean is checked by [`Completion::result`]).
    pub fn decode(e: &[u8; COMPLETION_SIZE as usize]) -> Self {
        Self {
            tag: u64::from_le_bytes(e[..8].try_into().expect("8 bytes")),
            status: i32::from_le_bytes(e[8..12].try_into().expect("4 bytes")),
            value: u32::from_le_bytes(e[12..].try_into().expect("4 bytes")),
        }
    }

    /// Whether a failure's reason went ahead of it.
    pub fn reason_sent(&self) -> bool {
        self.status != 0 && self.value == REASON_SENT
    }

    /// The result it carries, with the reason that went ahead of it.
    pub fn result<E: WireError>(&self, reason: Option<String>) -> Result<u32, E> {
        match self.status {
            0 => Ok(self.value),
            c => Err(E::from_wire(c, reason)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    enum E {
        Io(String),
        Full,
        Unknown(i32),
    }

    impl WireError for E {
        fn code(&self) -> i32 {
            match self {
                E::Io(_) => -1,
                E::Full => -2,
                E::Unknown(c) => *c,
            }
        }
        fn reason(&self) -> Option<&str> {
            match self {
                E::Io(s) => Some(s),
                _ => None,
            }
        }
        fn from_wire(code: i32, reason: Option<String>) -> Self {
            match code {
                -1 => E::Io(reason.unwrap_or_else(|| "no reason given".into())),
                -2 => E::Full,
                c => E::Unknown(c),
            }
        }
    }

    #[test]
    fn the_layout_is_tag_status_value() {
        let c = Completion::of::<E>(0x0102, &Err(E::Full));
        let e = c.encode();
        assert_eq!(&e[..8], &0x0102u64.to_le_bytes());
        assert_eq!(&e[8..12], &(-2i32).to_le_bytes());
        assert_eq!(Completion::decode(&e), c);
        assert_eq!(
            Completion::of::<E>(3, &Ok(4096)).encode()[12..],
            4096u32.to_le_bytes()
        );
    }

    #[test]
    fn a_failure_gets_its_words_back_only_when_they_were_sent() {
        let mut c = Completion::of::<E>(9, &Err(E::Io("medium error".into())));
        assert!(!c.reason_sent());
        assert_eq!(c.result::<E>(None), Err(E::Io("no reason given".into())));
        c.value = REASON_SENT;
        assert!(c.reason_sent());
        assert_eq!(
            c.result::<E>(Some("medium error".into())),
            Err(E::Io("medium error".into()))
        );
        // A success's value is never read as the flag.
        let ok = Completion::of::<E>(9, &Ok(REASON_SENT));
        assert!(!ok.reason_sent());
        assert_eq!(ok.result::<E>(None), Ok(REASON_SENT));
    }
}
