//! What one receiver asked to get: its receive mode, the multicast groups it joined and its
//! packet filter, and the rule that applies them to a frame. The dispatcher keeps one per
//! session; a colocated NIC keeps one for its only user — one rule, wherever the driver runs.

use crate::bpf::Program;
use crate::contract::{destination, Destination, ALL_MULTICAST, PROMISCUOUS};

/// A receiver's mode, groups and filter.
#[derive(Debug, Default, Clone)]
pub struct Reception {
    /// The packet filter (`None`: the address rule alone decides).
    pub filter: Option<Program>,
    /// [`PROMISCUOUS`], [`ALL_MULTICAST`].
    pub mode: u32,
    /// Multicast groups joined.
    pub groups: Vec<[u8; 6]>,
}

impl Reception {
    /// How many bytes of `frame` this receiver takes (0: not its frame) on a NIC whose address
    /// is `mac`: the address rule first (its NIC's address, broadcast, a group it joined, or
    /// everything in the modes that say so), then its filter, if it has one.
    pub fn takes(&self, frame: &[u8], mac: &[u8; 6]) -> u32 {
        let addressed = match destination(frame, mac) {
            Destination::Own | Destination::Broadcast => true,
            Destination::Multicast(g) => {
                self.mode & (ALL_MULTICAST | PROMISCUOUS) != 0 || self.groups.contains(&g)
            }
            Destination::Other => self.mode & PROMISCUOUS != 0,
        };
        if !addressed {
            return 0;
        }
        let whole = frame.len() as u32;
        match &self.filter {
            Some(p) => p.run(frame).min(whole),
            None => whole,
        }
    }

    /// The groups in `bytes` (six bytes each, as a multicast request carries them).
    pub fn set_groups(&mut self, bytes: &[u8]) {
        self.groups = bytes
            .chunks_exact(6)
            .map(|g| g.try_into().expect("6 bytes"))
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];

    fn frame(dst: [u8; 6]) -> Vec<u8> {
        let mut f = dst.to_vec();
        f.extend_from_slice(&[2, 0, 0, 0, 0, 2, 0x08, 0x00]);
        f.resize(60, 0);
        f
    }

    #[test]
    fn the_address_rule_follows_mode_and_groups() {
        let group = [0x01, 0x00, 0x5e, 0, 0, 1];
        let mut r = Reception::default();
        assert_eq!(r.takes(&frame(MAC), &MAC), 60);
        assert_eq!(r.takes(&frame([0xff; 6]), &MAC), 60);
        assert_eq!(r.takes(&frame(group), &MAC), 0);
        assert_eq!(r.takes(&frame([2, 0, 0, 0, 0, 9]), &MAC), 0);
        r.set_groups(&group);
        assert_eq!(r.takes(&frame(group), &MAC), 60);
        r.groups.clear();
        r.mode = ALL_MULTICAST;
        assert_eq!(r.takes(&frame(group), &MAC), 60);
        assert_eq!(r.takes(&frame([2, 0, 0, 0, 0, 9]), &MAC), 0);
        r.mode = PROMISCUOUS;
        assert_eq!(r.takes(&frame([2, 0, 0, 0, 0, 9]), &MAC), 60);
        assert_eq!(
            r.takes(&[1, 2, 3], &MAC),
            3,
            "promiscuous takes even a runt"
        );
    }

    #[test]
    fn a_filter_decides_after_the_address_rule() {
        // ret #20: the first 20 bytes of every frame it sees.
        let p = Program::from_text("{ 0x06, 0, 0, 0x00000014 },").unwrap();
        let r = Reception {
            filter: Some(p),
            ..Default::default()
        };
        assert_eq!(r.takes(&frame(MAC), &MAC), 20);
        assert_eq!(r.takes(&frame([2, 0, 0, 0, 0, 9]), &MAC), 0);
    }
}
