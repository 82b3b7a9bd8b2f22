//! The packet filter: classic BPF, as `tcpdump -dd` prints it and Linux's `SO_ATTACH_FILTER`
//! takes it (8 bytes an instruction: code u16, jt u8, jf u8, k u32, native order — little-endian
//! here). A program is checked once, when it is attached, the way the kernel's checker
//! (`bpf_check_classic`) does: 1 to [`MAX_INSNS`] instructions, known opcodes only, jumps
//! only forward and inside the program (so it always ends), scratch memory indices below 16
//! and never read before every path wrote them, no division by a constant 0, no shift by 32 or
//! more, and a `ret` at the end. Running it can then only end: a load past the frame, or a
//! division by a zero `X`, ends it with 0 (drop), as in the kernel. The value it returns is
//! how many bytes of the frame the session gets (0: not its frame).
//!
//! Left out: the kernel's ancillary loads (`SKF_AD_*`, offsets from −4096: VLAN tag, protocol,
//! …), which need metadata a frame here does not carry; such a program is refused by name.

/// Most instructions in a program (the kernel's `BPF_MAXINSNS`).
pub const MAX_INSNS: usize = 4096;
/// Scratch memory words (`BPF_MEMWORDS`).
pub const MEM_WORDS: u32 = 16;
/// Bytes of one instruction as attached.
pub const INSN_SIZE: usize = 8;

// Instruction classes, sizes, modes, operations and sources (`linux/bpf_common.h`).
const LD: u16 = 0x00;
const LDX: u16 = 0x01;
const ST: u16 = 0x02;
const STX: u16 = 0x03;
const ALU: u16 = 0x04;
const JMP: u16 = 0x05;
const RET: u16 = 0x06;
const MISC: u16 = 0x07;
const W: u16 = 0x00;
const H: u16 = 0x08;
const B: u16 = 0x10;
const IMM: u16 = 0x00;
const ABS: u16 = 0x20;
const IND: u16 = 0x40;
const MEM: u16 = 0x60;
const LEN: u16 = 0x80;
const MSH: u16 = 0xa0;
const ADD: u16 = 0x00;
const SUB: u16 = 0x10;
const MUL: u16 = 0x20;
const DIV: u16 = 0x30;
const OR: u16 = 0x40;
const AND: u16 = 0x50;
const LSH: u16 = 0x60;
const RSH: u16 = 0x70;
const NEG: u16 = 0x80;
const MOD: u16 = 0x90;
const XOR: u16 = 0xa0;
const JA: u16 = 0x00;
const JEQ: u16 = 0x10;
const JGT: u16 = 0x20;
const JGE: u16 = 0x30;
const JSET: u16 = 0x40;
const K: u16 = 0x00;
const X: u16 = 0x08;
const RET_A: u16 = 0x10;
const TAX: u16 = 0x00;
const TXA: u16 = 0x80;
/// Where the kernel's ancillary loads start (`SKF_AD_OFF`, −4096 as a u32).
const ANCILLARY: u32 = 0xffff_f000;

/// One instruction (`struct sock_filter`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Insn {
    /// Opcode.
    pub code: u16,
    /// Where to go when a conditional jump's test is true (instructions to skip).
    pub jt: u8,
    /// … and when it is false.
    pub jf: u8,
    /// The constant.
    pub k: u32,
}

impl Insn {
    /// Its 8 bytes as attached.
    pub fn to_bytes(self) -> [u8; INSN_SIZE] {
        let mut b = [0u8; INSN_SIZE];
        b[..2].copy_from_slice(&self.code.to_le_bytes());
        b[2] = self.jt;
        b[3] = self.jf;
        b[4..].copy_from_slice(&self.k.to_le_bytes());
        b
    }

    fn from_bytes(b: &[u8]) -> Self {
        Self {
            code: u16::from_le_bytes([b[0], b[1]]),
            jt: b[2],
            jf: b[3],
            k: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
        }
    }
}

/// A program that passed the checker: it can only end, and only read inside the frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    insns: Vec<Insn>,
}

/// What a scratch word an instruction touches, if any.
enum Scratch {
    None,
    Reads(u32),
    Writes(u32),
}

fn scratch(i: &Insn) -> Scratch {
    match i.code {
        c if c == LD | W | MEM || c == LDX | W | MEM => Scratch::Reads(i.k),
        c if c == ST || c == STX => Scratch::Writes(i.k),
        _ => Scratch::None,
    }
}

/// Whether `code` is an instruction the checker knows, and the words if not.
fn known(code: u16) -> bool {
    const ALLOWED: &[u16] = &[
        LD | W | ABS,
        LD | H | ABS,
        LD | B | ABS,
        LD | W | IND,
        LD | H | IND,
        LD | B | IND,
        LD | W | LEN,
        LD | IMM,
        LD | W | MEM,
        LDX | W | IMM,
        LDX | W | MEM,
        LDX | W | LEN,
        LDX | B | MSH,
        ST,
        STX,
        ALU | NEG,
        MISC | TAX,
        MISC | TXA,
        RET | K,
        RET | RET_A,
        JMP | JA,
    ];
    if ALLOWED.contains(&code) {
        return true;
    }
    let op = code & 0xf0;
    let src = code & 0x08;
    let rest = code & !0xf8;
    match code & 0x07 {
        ALU => {
            rest == ALU
                && [ADD, SUB, MUL, DIV, OR, AND, LSH, RSH, MOD, XOR].contains(&op)
                && (src == K || src == X)
        }
        JMP => rest == JMP && [JEQ, JGT, JGE, JSET].contains(&op),
        _ => false,
    }
}

impl Program {
    /// Checks a program as attached (8 bytes an instruction); the error names the instruction
    /// and what is wrong with it.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        if bytes.is_empty() || !bytes.len().is_multiple_of(INSN_SIZE) {
            return Err(format!(
                "{} bytes is not a whole number of {INSN_SIZE}-byte instructions",
                bytes.len()
            ));
        }
        Self::check(bytes.chunks(INSN_SIZE).map(Insn::from_bytes).collect())
    }

    /// Checks a program given as instructions.
    pub fn check(insns: Vec<Insn>) -> Result<Self, String> {
        let n = insns.len();
        if n == 0 || n > MAX_INSNS {
            return Err(format!("{n} instructions: a program has 1 to {MAX_INSNS}"));
        }
        for (pc, i) in insns.iter().enumerate() {
            let at = |why: String| format!("instruction {pc} ({:#06x}): {why}", i.code);
            if !known(i.code) {
                return Err(at("unknown opcode".into()));
            }
            let class = i.code & 0x07;
            if (class == LD || class == LDX)
                && matches!(i.code & 0xe0, ABS | IND)
                && i.k >= ANCILLARY
            {
                return Err(at(format!(
                    "offset {:#x} is an ancillary-data load (SKF_AD_*), which Outboard does not provide",
                    i.k
                )));
            }
            if class == ALU && i.code & 0x08 == K {
                match i.code & 0xf0 {
                    DIV | MOD if i.k == 0 => return Err(at("division by the constant 0".into())),
                    LSH | RSH if i.k >= 32 => return Err(at(format!("a shift by {} bits", i.k))),
                    _ => {}
                }
            }
            if let Scratch::Reads(k) | Scratch::Writes(k) = scratch(i) {
                if k >= MEM_WORDS {
                    return Err(at(format!("scratch word {k} (there are {MEM_WORDS})")));
                }
            }
            if class == JMP {
                let left = (n - pc - 1) as u64;
                let fits = if i.code & 0xf0 == JA {
                    u64::from(i.k) < left
                } else {
                    u64::from(i.jt) < left && u64::from(i.jf) < left
                };
                if !fits {
                    return Err(at("a jump past the end of the program".into()));
                }
            }
        }
        if insns[n - 1].code & 0x07 != RET {
            return Err(format!(
                "instruction {} is not a ret: a program must end with one",
                n - 1
            ));
        }
        check_scratch(&insns)?;
        Ok(Self { insns })
    }

    /// The instructions.
    pub fn insns(&self) -> &[Insn] {
        &self.insns
    }

    /// Its bytes as attached.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.insns.iter().flat_map(|i| i.to_bytes()).collect()
    }

    /// Runs the program on `frame`: how many of its bytes the session takes (0: none).
    pub fn run(&self, frame: &[u8]) -> u32 {
        let (mut a, mut x) = (0u32, 0u32);
        let mut mem = [0u32; MEM_WORDS as usize];
        let mut pc = 0usize;
        let load = |at: u32, size: u32| -> Option<u32> {
            let start = at as usize;
            let b = frame.get(start..start.checked_add(size as usize)?)?;
            Some(b.iter().fold(0u32, |v, &byte| v << 8 | u32::from(byte)))
        };
        // The checker made every jump go forward and the last instruction a ret: the loop ends.
        loop {
            let i = self.insns[pc];
            pc += 1;
            let src = if i.code & 0x08 == X { x } else { i.k };
            match i.code & 0x07 {
                LD | LDX => {
                    let size = match i.code & 0x18 {
                        W => 4,
                        H => 2,
                        _ => 1,
                    };
                    let v = match i.code & 0xe0 {
                        IMM => i.k,
                        LEN => frame.len() as u32,
                        MEM => mem[i.k as usize],
                        ABS => match load(i.k, size) {
                            Some(v) => v,
                            None => return 0,
                        },
                        IND => match x.checked_add(i.k).and_then(|at| load(at, size)) {
                            Some(v) => v,
                            None => return 0,
                        },
                        // MSH: four times the low nibble of a byte (an IPv4 header's length).
                        _ => match load(i.k, 1) {
                            Some(v) => (v & 0xf) << 2,
                            None => return 0,
                        },
                    };
                    if i.code & 0x07 == LD {
                        a = v;
                    } else {
                        x = v;
                    }
                }
                ST => mem[i.k as usize] = a,
                STX => mem[i.k as usize] = x,
                ALU => {
                    a = match i.code & 0xf0 {
                        ADD => a.wrapping_add(src),
                        SUB => a.wrapping_sub(src),
                        MUL => a.wrapping_mul(src),
                        DIV => match a.checked_div(src) {
                            Some(v) => v,
                            None => return 0,
                        },
                        MOD => match a.checked_rem(src) {
                            Some(v) => v,
                            None => return 0,
                        },
                        OR => a | src,
                        AND => a & src,
                        XOR => a ^ src,
                        LSH => a.wrapping_shl(src),
                        RSH => a.wrapping_shr(src),
                        _ => a.wrapping_neg(),
                    }
                }
                JMP => {
                    let skip = match i.code & 0xf0 {
                        JA => i.k as usize,
                        op => {
                            let yes = match op {
                                JEQ => a == src,
                                JGT => a > src,
                                JGE => a >= src,
                                _ => a & src != 0,
                            };
                            usize::from(if yes { i.jt } else { i.jf })
                        }
                    };
                    pc += skip;
                }
                RET => return if i.code & 0x18 == RET_A { a } else { i.k },
                _ => {
                    if i.code & 0xf8 == TXA {
                        a = x;
                    } else {
                        x = a;
                    }
                }
            }
        }
    }

    /// Reads a program as `tcpdump -dd` prints it (`{ 0x28, 0, 0, 0x0000000c },` an
    /// instruction) or as `tcpdump -ddd` does (the count, then `code jt jf k` in decimal a
    /// line), and checks it.
    pub fn from_text(text: &str) -> Result<Self, String> {
        let number = |s: &str| -> Result<u64, String> {
            let s = s.trim();
            let v = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => s.parse(),
            };
            v.map_err(|_| format!("{s:?} is not a number"))
        };
        let insn = |f: &[&str]| -> Result<Insn, String> {
            let [c, jt, jf, k] = f else {
                return Err(format!(
                    "an instruction has four fields (code, jt, jf, k), not {}",
                    f.len()
                ));
            };
            let field = |s: &str, max: u64, what: &str| {
                let v = number(s)?;
                if v > max {
                    return Err(format!("{what} {v} is too large"));
                }
                Ok(v)
            };
            Ok(Insn {
                code: field(c, u16::MAX.into(), "code")? as u16,
                jt: field(jt, u8::MAX.into(), "jt")? as u8,
                jf: field(jf, u8::MAX.into(), "jf")? as u8,
                k: field(k, u32::MAX.into(), "k")? as u32,
            })
        };
        let mut insns = Vec::new();
        if text.contains('{') {
            for (n, group) in text.split('{').skip(1).enumerate() {
                let body = group
                    .split('}')
                    .next()
                    .filter(|_| group.contains('}'))
                    .ok_or_else(|| format!("instruction {n}: no closing brace"))?;
                let fields: Vec<&str> = body.split(',').collect();
                insns.push(insn(&fields).map_err(|e| format!("instruction {n}: {e}"))?);
            }
        } else {
            let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
            let count = lines
                .next()
                .ok_or("an empty program")
                .and_then(|l| number(l).map_err(|_| "the first line is not the count"))?;
            for (n, line) in lines.enumerate() {
                let fields: Vec<&str> = line.split_whitespace().collect();
                insns.push(insn(&fields).map_err(|e| format!("instruction {n}: {e}"))?);
            }
            if insns.len() as u64 != count {
                return Err(format!(
                    "the program says {count} instructions and has {}",
                    insns.len()
                ));
            }
        }
        Self::check(insns)
    }
}

/// Every scratch word read is written first on every path to the read (jumps go only
/// forward, so one pass in order sees every path's writes before the read).
fn check_scratch(insns: &[Insn]) -> Result<(), String> {
    // For each reachable instruction, the words written on every path to it.
    let mut written: Vec<Option<u16>> = vec![None; insns.len()];
    written[0] = Some(0);
    for (pc, i) in insns.iter().enumerate() {
        let Some(mut mask) = written[pc] else {
            continue;
        };
        match scratch(i) {
            Scratch::Reads(k) if mask & (1 << k) == 0 => {
                return Err(format!(
                    "instruction {pc} ({:#06x}): reads scratch word {k} before it is written",
                    i.code
                ));
            }
            Scratch::Writes(k) => mask |= 1 << k,
            _ => {}
        }
        let mut reach = |to: usize| {
            written[to] = Some(written[to].map_or(mask, |m| m & mask));
        };
        match i.code & 0x07 {
            RET => {}
            JMP if i.code & 0xf0 == JA => reach(pc + 1 + i.k as usize),
            JMP => {
                reach(pc + 1 + usize::from(i.jt));
                reach(pc + 1 + usize::from(i.jf));
            }
            _ => reach(pc + 1),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `tcpdump -dd udp` (IPv4 and IPv6), as tcpdump 4.99 prints it.
    const UDP: &str = "{ 0x28, 0, 0, 0x0000000c },
{ 0x15, 0, 5, 0x000086dd },
{ 0x30, 0, 0, 0x00000014 },
{ 0x15, 6, 0, 0x00000011 },
{ 0x15, 0, 6, 0x0000002c },
{ 0x30, 0, 0, 0x00000036 },
{ 0x15, 3, 4, 0x00000011 },
{ 0x15, 0, 3, 0x00000800 },
{ 0x30, 0, 0, 0x00000017 },
{ 0x15, 0, 1, 0x00000011 },
{ 0x6, 0, 0, 0x00040000 },
{ 0x6, 0, 0, 0x00000000 },";

    fn frame(ethertype: u16, proto: u8) -> Vec<u8> {
        let mut f = vec![0u8; 64];
        f[12..14].copy_from_slice(&ethertype.to_be_bytes());
        f[14] = 0x45;
        f[23] = proto;
        f[20] = proto; // the IPv6 next-header byte
        f
    }

    #[test]
    fn tcpdumps_udp_filter_takes_udp_and_nothing_else() {
        let p = Program::from_text(UDP).unwrap();
        assert_eq!(p.insns().len(), 12);
        assert_eq!(p.run(&frame(0x0800, 17)), 0x40000);
        assert_eq!(p.run(&frame(0x0800, 6)), 0);
        assert_eq!(p.run(&frame(0x86dd, 17)), 0x40000);
        assert_eq!(p.run(&frame(0x0806, 17)), 0);
        // Too short to hold the protocol byte: the load ends the program with 0.
        assert_eq!(p.run(&frame(0x0800, 17)[..20]), 0);
        // The same program as `tcpdump -ddd` prints it, and as bytes.
        let ddd: String = std::iter::once("12".to_string())
            .chain(
                p.insns()
                    .iter()
                    .map(|i| format!("{} {} {} {}", i.code, i.jt, i.jf, i.k)),
            )
            .collect::<Vec<_>>()
            .join("\n");
        assert_eq!(Program::from_text(&ddd).unwrap(), p);
        assert_eq!(Program::parse(&p.to_bytes()).unwrap(), p);
    }

    fn refused(insns: &[(u16, u8, u8, u32)]) -> String {
        let v = insns
            .iter()
            .map(|&(code, jt, jf, k)| Insn { code, jt, jf, k })
            .collect();
        Program::check(v).unwrap_err()
    }

    #[test]
    fn the_checker_refuses_what_the_kernels_does() {
        assert!(Program::parse(&[]).is_err());
        assert!(Program::parse(&[0; 12]).is_err());
        assert!(refused(&[(0x28, 0, 0, 12)]).contains("ret"));
        assert!(refused(&[(0xff, 0, 0, 0), (6, 0, 0, 0)]).contains("unknown opcode"));
        assert!(refused(&[(0x15, 1, 0, 0), (6, 0, 0, 0)]).contains("past the end"));
        assert!(refused(&[(0x05, 0, 0, 1), (6, 0, 0, 0)]).contains("past the end"));
        assert!(refused(&[(0x34, 0, 0, 0), (6, 0, 0, 0)]).contains("division"));
        assert!(refused(&[(0x94, 0, 0, 0), (6, 0, 0, 0)]).contains("division"));
        assert!(refused(&[(0x64, 0, 0, 32), (6, 0, 0, 0)]).contains("shift"));
        assert!(refused(&[(0x60, 0, 0, 16), (6, 0, 0, 0)]).contains("scratch word 16"));
        assert!(refused(&[(0x60, 0, 0, 3), (0x16, 0, 0, 0)]).contains("before it is written"));
        assert!(refused(&[(0x20, 0, 0, 0xffff_f000), (6, 0, 0, 0)]).contains("ancillary"));
        // Written on one path only: still refused.
        let one_path = [
            (0x15, 0, 1, 0), // jeq #0, +0, +1
            (0x02, 0, 0, 2), // st M[2]
            (0x60, 0, 0, 2), // ld M[2]
            (0x16, 0, 0, 0), // ret a
        ];
        assert!(refused(&one_path).contains("before it is written"));
        let too_long = vec![
            Insn {
                code: 6,
                jt: 0,
                jf: 0,
                k: 0
            };
            MAX_INSNS + 1
        ];
        assert!(Program::check(too_long).is_err());
        assert!(Program::from_text("{ 0x6, 0, 0 }").is_err());
        assert!(Program::from_text("{ 0x6, 0, 0, 0x1ffffffff }").is_err());
        assert!(Program::from_text("2\n6 0 0 0").is_err());
    }

    #[test]
    fn arithmetic_memory_and_the_header_length_load() {
        let p = Program::check(
            [
                (0xb1u16, 0u8, 0u8, 14u32), // ldx 4*([14]&0xf)
                (0x87, 0, 0, 0),            // txa
                (0x02, 0, 0, 0),            // st M[0]
                (0x04, 0, 0, 2),            // add #2
                (0x61, 0, 0, 0),            // ldx M[0]
                (0x3c, 0, 0, 0),            // div x
                (0x16, 0, 0, 0),            // ret a
            ]
            .iter()
            .map(|&(code, jt, jf, k)| Insn { code, jt, jf, k })
            .collect(),
        )
        .unwrap();
        let mut f = vec![0u8; 20];
        f[14] = 0x45; // 20-byte header: X = 20, A = (20 + 2) / 20 = 1
        assert_eq!(p.run(&f), 1);
        f[14] = 0x40; // X = 0: the division ends the program with 0
        assert_eq!(p.run(&f), 0);
    }

    proptest! {
        /// Whatever bytes are attached, the checker answers, and a program it takes runs to an
        /// end on any frame without reading outside it.
        #[test]
        fn any_program_is_checked_and_a_checked_one_always_ends(
            raw in proptest::collection::vec(any::<(u16, u8, u8, u32)>(), 1..40),
            frame in proptest::collection::vec(any::<u8>(), 0..100),
        ) {
            let mut insns: Vec<Insn> = raw.iter().map(|&(code, jt, jf, k)| Insn {
                // Mostly known opcodes, so that some programs pass.
                code: code & 0xff, jt: jt % 4, jf: jf % 4, k: k % 128,
            }).collect();
            insns.push(Insn { code: 0x16, jt: 0, jf: 0, k: 0 });
            if let Ok(p) = Program::check(insns) {
                let _ = p.run(&frame);
            }
        }
    }
}
