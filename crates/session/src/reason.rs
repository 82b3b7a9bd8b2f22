//! Why a request failed, in words, beside its completion.
//!
//! A completion entry is small (block's is 16 bytes) and carries a code; the reason behind it
//! ("sector 8 is past the end", the device's own status, the text a driver gave up with) would
//! not fit, and the common case — success — must not pay for it. So a class that declares the
//! [`RingShape::request_reply`](crate::RingShape::request_reply) shape gets a third ring, of
//! reasons, from the server to the client. For a failed request the server posts the reason
//! first, then the completion with a flag saying a reason went ahead of it (where the flag
//! lives is the class's: block uses the completion's byte count, which a failure does not
//! need). The client, reading a flagged completion, takes the next reason and checks its tag.
//!
//! Both rings have the same capacity and a reason is only ever posted with a flagged
//! completion, so while the client takes a reason with each flagged completion the reasons
//! ring cannot fill before the completion ring. A client that does not read them only loses
//! the words: when the ring is full the server sends the completion without a reason, and
//! the code alone still says what failed.
//!
//! Entry layout ([`REASON_SIZE`] bytes, little-endian): tag u64 at 0, text length u16 at 8,
//! two reserved bytes, UTF-8 text from 12. The text is untrusted by the client: a length past
//! the entry is refused and invalid UTF-8 is replaced, never trusted.

/// Bytes per reason entry.
pub const REASON_SIZE: u32 = 128;
/// Longest reason text; longer reasons are cut at a character boundary.
pub const REASON_TEXT: usize = REASON_SIZE as usize - 12;

/// Encodes the reason for the request `tag`.
pub fn encode(tag: u64, text: &str) -> [u8; REASON_SIZE as usize] {
    let mut cut = text.len().min(REASON_TEXT);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut e = [0u8; REASON_SIZE as usize];
    e[..8].copy_from_slice(&tag.to_le_bytes());
    e[8..10].copy_from_slice(&(cut as u16).to_le_bytes());
    e[12..12 + cut].copy_from_slice(&text.as_bytes()[..cut]);
    e
}

/// Decodes an entry from the server: the tag and the text, or `None` for an entry no correct
/// server writes (a length past the entry).
pub fn decode(e: &[u8; REASON_SIZE as usize]) -> Option<(u64, String)> {
    let tag = u64::from_le_bytes(e[..8].try_into().expect("8 bytes"));
    let len = u16::from_le_bytes([e[8], e[9]]) as usize;
    let text = e.get(12..12 + len).filter(|_| len <= REASON_TEXT)?;
    Some((tag, String::from_utf8_lossy(text).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reason_round_trips() {
        let e = encode(7, "sector 8 is past the end");
        assert_eq!(decode(&e), Some((7, "sector 8 is past the end".into())));
    }

    #[test]
    fn a_long_reason_is_cut_at_a_character_boundary() {
        let long = "é".repeat(100); // 200 bytes, two per character
        let (_, text) = decode(&encode(1, &long)).unwrap();
        assert_eq!(text.len(), REASON_TEXT - REASON_TEXT % 2);
        assert!(long.starts_with(&text));
    }

    #[test]
    fn a_hostile_entry_is_refused_or_made_safe() {
        let mut e = encode(1, "ok");
        e[8..10].copy_from_slice(&200u16.to_le_bytes());
        assert_eq!(decode(&e), None);
        let mut e = encode(1, "ok");
        e[12] = 0xff;
        assert_eq!(decode(&e), Some((1, "\u{fffd}k".into())));
    }
}
