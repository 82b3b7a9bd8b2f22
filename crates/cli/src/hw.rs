//! `outboard hw …`: the host's PCI functions (list, bind, unbind: `pci.rs`) and bring-up tools
//! for one device, like `lspci -vv` and a driver self-test.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Subcommand};
use outboard_drivers::virtio::{virtio_caps, Transport};
use outboard_drivers::virtio_blk::{BlkDriverOptions, BlkOp, BlkRequest, VirtioBlk};
use outboard_hw::{DeviceSpec, IrqKind, PciFunction, RegionKind};
use outboard_spec::{pci, virtio, virtio_blk};

#[derive(Subcommand)]
pub enum HwCommand {
    /// List the host's PCI functions: address, vendor:device, class, kernel driver, IOMMU
    /// group and whether VFIO can take it, the Outboard driver that would match (and its
    /// score), and what uses the function now. Reads only.
    List(crate::pci::ListArgs),
    /// Hand a function to vfio-pci (driver_override, unbind, probe) so that Outboard can
    /// serve it, remembering its kernel driver. Refused, before anything is written, on a
    /// machine without IOMMU groups, for a bridge, or while its kernel driver uses it (a
    /// mounted disk, an interface that is up, the console) unless --force.
    Bind(crate::pci::BindArgs),
    /// Give a function back from vfio-pci to the kernel driver it came from (or the one the
    /// kernel picks). Refused while a process holds its VFIO group open.
    Unbind(crate::pci::UnbindArgs),
    /// Print a device's identity, BARs and how each is reached, capabilities (virtio decoded),
    /// interrupts and offered features.
    Probe(Target),
    /// Match a driver, bring the device up and test it. Read-only unless --write.
    Selftest(SelftestArgs),
    /// Point one read at an IOVA that is not mapped and report what happens: a test of the
    /// IOMMU set-up (with VFIO the kernel logs a DMAR fault; a device model reports an I/O
    /// error). Reads only.
    DmaFault(Target),
    /// Measure access costs: a trapped register read, a doorbell write, a null request round
    /// trip (doorbell, device, interrupt), and 4 KiB random reads at queue depth 1 and 32.
    /// Read-only.
    Latency(LatencyArgs),
}

#[derive(Args)]
pub struct LatencyArgs {
    #[command(flatten)]
    target: Target,
    /// Operations per measurement.
    #[arg(long, default_value_t = 20000)]
    iterations: u32,
}

/// Which device.
#[derive(Args)]
#[group(required = true, multiple = false)]
pub struct Target {
    /// A device model's vfio-user socket.
    #[arg(long, value_name = "PATH")]
    vfio_user: Option<PathBuf>,
    /// A PCI function bound to vfio-pci, e.g. 0000:00:04.0.
    #[arg(long, value_name = "BDF")]
    vfio: Option<String>,
}

impl Target {
    pub fn spec(&self) -> DeviceSpec {
        match (&self.vfio_user, &self.vfio) {
            (Some(p), _) => DeviceSpec::VfioUser(p.clone()),
            (None, Some(b)) => DeviceSpec::Vfio(b.clone()),
            (None, None) => unreachable!("clap requires one"),
        }
    }
}

#[derive(Args)]
pub struct SelftestArgs {
    #[command(flatten)]
    target: Target,
    /// Also run a verified write/read/flush test on a scratch range, then put the original
    /// bytes back.
    #[arg(long)]
    write: bool,
    /// First sector of the scratch range (default: the last 128 sectors of the disk).
    #[arg(long, value_name = "SECTOR")]
    scratch_sector: Option<u64>,
    /// Test through this block driver (personality) and the block class instead of the
    /// native virtio-blk chip driver, e.g. virtio-drivers-blk (the virtio-drivers crate,
    /// hosted unmodified).
    #[arg(long, value_name = "DRIVER")]
    driver: Option<String>,
    /// Run the block class's conformance suite through the block class (the same checks the
    /// test suite holds every block driver to): queued and synchronous verified I/O, refusals,
    /// flush, write zeroes, discard. It OVERWRITES the disk's first 8 MiB and its last 160 KiB
    /// and puts nothing back: only for a scratch disk.
    #[arg(long)]
    suite: bool,
}

pub fn run(c: HwCommand) -> Result<ExitCode, String> {
    match c {
        HwCommand::List(a) => crate::pci::list(&a),
        HwCommand::Bind(a) => crate::pci::bind(&a),
        HwCommand::Unbind(a) => crate::pci::unbind(&a),
        HwCommand::Probe(t) => probe(&t.spec()).map(|()| ExitCode::SUCCESS),
        HwCommand::Selftest(a) => selftest(&a),
        HwCommand::DmaFault(t) => dma_fault(&t.spec()),
        HwCommand::Latency(a) => {
            crate::latency::run(&a.target.spec(), a.iterations).map(|()| ExitCode::SUCCESS)
        }
    }
}

fn size(n: u64) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

fn probe(spec: &DeviceSpec) -> Result<(), String> {
    let f = PciFunction::open(spec).map_err(|e| e.to_string())?;
    let id = f.identity();
    println!("{spec}");
    println!(
        "  {:04x}:{:04x}  class {:02x}{:02x}{:02x} ({})  rev {:02x}",
        id.vendor,
        id.device,
        id.class,
        id.subclass,
        id.prog_if,
        pci::class_name(id.class, id.subclass),
        id.revision
    );
    println!(
        "  subsystem {:04x}:{:04x}",
        id.subsystem_vendor, id.subsystem
    );
    match outboard_drivers::probe_driver(&outboard_drivers::Probe::Pci(&f)) {
        Ok(p) => println!(
            "  driver: {} (class {}, probe score {})",
            p.personality.driver, p.personality.class, p.score
        ),
        Err(why) => println!("  driver: none ({why})"),
    }
    let sizes = f.bar_sizes().map_err(|e| e.to_string())?;
    println!("  BARs:");
    for (bar, &sz) in sizes.iter().enumerate() {
        if sz == 0 {
            continue;
        }
        let mut parts = Vec::new();
        if let Ok(r) = f.region(bar as u8) {
            for k in r.layout() {
                parts.push(match k {
                    RegionKind::Mapped { offset, size: s } => format!("mmap {offset:#x}+{s:#x}"),
                    RegionKind::Doorbell { offset, .. } => format!("ioeventfd {offset:#x}"),
                    RegionKind::Trapped => "rest trapped".into(),
                });
            }
        }
        println!("    BAR{bar}  {:>8}  {}", size(sz), parts.join(", "));
    }
    println!("  capabilities:");
    let caps = f.capabilities().map_err(|e| e.to_string())?;
    let vcaps = virtio_caps(&f).unwrap_or_default();
    for c in &caps {
        let detail = match c.id {
            pci::CAP_ID_MSIX => {
                let ctrl = f
                    .config_read16(c.offset as u64 + pci::msix::MESSAGE_CONTROL)
                    .unwrap_or(0);
                let table = f
                    .config_read32(c.offset as u64 + pci::msix::TABLE)
                    .unwrap_or(0);
                let pba = f
                    .config_read32(c.offset as u64 + pci::msix::PBA)
                    .unwrap_or(0);
                format!(
                    ": {} vectors, table BAR{}+{:#x}, PBA BAR{}+{:#x}{}",
                    (ctrl & pci::msix::CONTROL_TABLE_SIZE_MASK) + 1,
                    table & pci::msix::BIR_MASK,
                    table & !pci::msix::BIR_MASK,
                    pba & pci::msix::BIR_MASK,
                    pba & !pci::msix::BIR_MASK,
                    if ctrl & pci::msix::CONTROL_ENABLE != 0 {
                        ", enabled"
                    } else {
                        ""
                    }
                )
            }
            pci::CAP_ID_VENDOR => match vcaps.iter().find(|v| v.at == c.offset) {
                Some(v) => format!(
                    ": virtio {} BAR{}+{:#x} len {:#x}{}",
                    virtio::cap::name(v.cfg_type),
                    v.bar,
                    v.offset,
                    v.length,
                    if v.cfg_type == virtio::cap::NOTIFY_CFG {
                        format!(" multiplier {}", v.multiplier)
                    } else {
                        String::new()
                    }
                ),
                None => String::new(),
            },
            _ => String::new(),
        };
        println!("    [{:02x}] {}{detail}", c.offset, pci::cap_name(c.id));
    }
    let irqs: Vec<String> = IrqKind::ALL
        .iter()
        .map(|k| format!("{k} {}", f.irq_count(*k).unwrap_or(0)))
        .collect();
    println!("  interrupts: {}", irqs.join(", "));
    if id.vendor == virtio::PCI_VENDOR_ID {
        if let Ok(t) = Transport::new(&f) {
            let feats = t.device_features().map_err(|e| e.to_string())?;
            let blk = id.device == virtio::PCI_DEVICE_ID_BASE + virtio::DEVICE_ID_BLOCK;
            let names: Vec<String> = (0..64)
                .filter(|b| feats & (1u64 << b) != 0)
                .map(|b| {
                    virtio::feature::name(b)
                        .or(if blk {
                            virtio_blk::feature::name(b)
                        } else {
                            None
                        })
                        .map_or_else(|| format!("bit{b}"), str::to_owned)
                })
                .collect();
            println!("  virtio features offered: {}", names.join(" "));
        }
    }
    Ok(())
}

/// A self-test's table: a line per step (ok or FAIL, its time, what it saw), and the verdict.
#[derive(Default)]
pub(crate) struct Report {
    failed: bool,
}

impl Report {
    /// Says whether every step passed, as the last line and the exit status.
    pub(crate) fn verdict(&self, what: &str) -> ExitCode {
        if self.failed {
            println!("{what} FAILED");
            ExitCode::FAILURE
        } else {
            println!("{what} passed");
            ExitCode::SUCCESS
        }
    }

    /// Runs one step and prints its line; its value if it passed.
    pub(crate) fn step<T>(
        &mut self,
        name: &str,
        f: impl FnOnce() -> Result<(T, String), String>,
    ) -> Option<T> {
        let t0 = Instant::now();
        let r = f();
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        match r {
            Ok((v, detail)) => {
                println!("  ok    {name:<44} {ms:>8.2} ms  {detail}");
                Some(v)
            }
            Err(e) => {
                println!("  FAIL  {name:<44} {ms:>8.2} ms  {e}");
                self.failed = true;
                None
            }
        }
    }
}

/// The self-test through the block class, with a named block driver (`--driver`) or the one
/// the probe picks: the same checks any block driver must pass, on the scratch range (its
/// bytes put back after), or the class's whole conformance suite (`--suite`).
fn class_selftest(a: &SelftestArgs) -> Result<ExitCode, String> {
    use outboard_block::{BlockDevice, BlockError, BlockOp, BlockRequest};
    let spec = a.target.spec();
    let opts = outboard_drivers::StartOptions {
        name: "selftest".into(),
        queues: 1,
        ..Default::default()
    };
    let mut rep = Report::default();
    let name = a.driver.as_deref();
    let Some(mut d) = rep.step(
        &format!("bring-up of {}", name.unwrap_or("the probe's driver")),
        || {
            let started = outboard_drivers::start(
                &outboard_drivers::Attachment::Pci(spec.clone()),
                name,
                &opts,
            )
            .map_err(|e| e.to_string())?;
            let driver_name = started.personality.driver;
            let driver = outboard_block::unbind(started.driver).map_err(|e| e.to_string())?;
            let d = outboard_block_client::Colocated::with_driver(driver, &started.env, 1 << 20)
                .map_err(|e| e.to_string())?;
            let i = d.info();
            let detail = format!(
                "{driver_name}: {} blocks of {} B, queue depth {}",
                i.capacity, i.block_size, i.queue_depth
            );
            Ok((d, detail))
        },
    ) else {
        return Ok(ExitCode::FAILURE);
    };
    if a.suite {
        // The first check, the geometry, says whether the rest can run.
        for (i, c) in outboard_block::conformance::CHECKS.iter().enumerate() {
            if rep
                .step(c.name, || (c.run)(&mut d).map(|detail| ((), detail)))
                .is_none()
                && i == 0
            {
                break;
            }
        }
        return Ok(rep.verdict("suite"));
    }
    let info = d.info().clone();
    let bs = info.block_size as usize;
    let blocks = (64 * 1024 / bs).min(info.capacity as usize) as u64;
    let first = a
        .scratch_sector
        .map(|s| s * 512 / bs as u64)
        .unwrap_or(info.capacity - blocks);
    rep.step("out-of-range read is refused", || {
        let r = BlockRequest {
            op: BlockOp::Read,
            lba: info.capacity,
            blocks: 1,
            buf_offset: 0,
            tag: 1,
        };
        match d.execute(&r) {
            Err(BlockError::OutOfRange) => Ok(((), String::new())),
            other => Err(format!("expected out of range, got {other:?}")),
        }
    });
    if a.write {
        let len = blocks as usize * bs;
        let mut original = vec![0u8; len];
        let saved = rep.step("read the scratch range", || {
            d.read_blocks(first, &mut original)
                .map(|()| ((), format!("blocks {first}..{}", first + blocks)))
                .map_err(|e| e.to_string())
        });
        if saved.is_some() {
            rep.step("write, flush, read back, compare", || {
                let pattern: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
                d.write_blocks(first, &pattern).map_err(|e| e.to_string())?;
                d.flush().map_err(|e| e.to_string())?;
                let mut back = vec![0u8; len];
                d.read_blocks(first, &mut back).map_err(|e| e.to_string())?;
                if back != pattern {
                    return Err("the bytes read back differ from those written".into());
                }
                Ok(((), format!("{len} bytes")))
            });
            rep.step("write zeroes, read zeroes", || {
                let r = BlockRequest {
                    op: BlockOp::WriteZeroes,
                    lba: first,
                    blocks: blocks as u32,
                    buf_offset: 0,
                    tag: 2,
                };
                d.execute(&r).map_err(|e| e.to_string())?;
                let mut back = vec![1u8; len];
                d.read_blocks(first, &mut back).map_err(|e| e.to_string())?;
                if back.iter().any(|&b| b != 0) {
                    return Err("not zeroes".into());
                }
                Ok(((), String::new()))
            });
            rep.step("put the original bytes back", || {
                d.write_blocks(first, &original)
                    .and_then(|()| d.flush())
                    .map(|()| ((), String::new()))
                    .map_err(|e| e.to_string())
            });
        }
    }
    Ok(rep.verdict("selftest"))
}

fn selftest(a: &SelftestArgs) -> Result<ExitCode, String> {
    if a.driver.is_some() || a.suite {
        return class_selftest(a);
    }
    let spec = a.target.spec();
    let f = PciFunction::open(&spec).map_err(|e| e.to_string())?;
    let id = f.identity();
    let p = outboard_drivers::probe_driver(&outboard_drivers::Probe::Pci(&f))
        .map_err(|why| format!("{:04x}:{:04x}: {why}", id.vendor, id.device))?;
    println!(
        "selftest of {spec}: {:04x}:{:04x} matched driver {} (score {})",
        id.vendor, id.device, p.personality.driver, p.score
    );
    let mut rep = Report::default();
    let Some(mut d) = rep.step("bring-up", || {
        let d = VirtioBlk::new(f, BlkDriverOptions::default()).map_err(|e| e.to_string())?;
        let i = d.info();
        let detail = format!(
            "{} queue(s) x {}, {}, features {:#x}",
            i.queues,
            i.queue_size,
            if i.msix { "MSI-X" } else { "INTx" },
            i.features
        );
        Ok((d, detail))
    }) else {
        return Ok(ExitCode::FAILURE);
    };
    let info = d.info();
    println!(
        "        disk: {} ({} sectors of 512 B), block size {}, {}",
        size(info.capacity * 512),
        info.capacity,
        info.block_size,
        if info.read_only {
            "read-only"
        } else {
            "read-write"
        }
    );
    let buf = d
        .function()
        .dma()
        .alloc(1 << 20)
        .map_err(|e| e.to_string())?;
    rep.step("device id", || {
        d.device_id()
            .map(|s| ((), format!("{s:?}")))
            .map_err(|e| e.to_string())
    });
    // Everything in whole logical blocks: a disk with 4 KiB blocks fails 512-byte requests.
    let bs = info.block_size;
    let per_block = bs as u64 / 512;
    rep.step("read first and last block", || {
        d.read(0, &buf, 0, bs).map_err(|e| e.to_string())?;
        d.read(info.capacity - per_block, &buf, bs as u64, bs)
            .map_err(|e| e.to_string())?;
        Ok(((), String::new()))
    });
    let unit = bs.max(4096) as u64;
    let n = 64u64.min(info.capacity * 512 / unit).min((1 << 19) / unit);
    rep.step(
        &format!("{n} x {} reads, queue depth 32, twice", size(unit)),
        || {
            let first = batch_read(&mut d, &buf, n, unit, 0)?;
            let second = batch_read(&mut d, &buf, n, unit, n * unit)?;
            if first != second {
                return Err("two reads of the same sectors differ".into());
            }
            Ok(((), "both passes identical".into()))
        },
    );
    rep.step("out-of-range read is refused", || {
        match d.read(info.capacity, &buf, 0, bs) {
            Err(outboard_drivers::virtio_blk::BlkError::OutOfRange { .. }) => {
                Ok(((), String::new()))
            }
            other => Err(format!("expected an out-of-range error, got {other:?}")),
        }
    });
    if a.write {
        if info.read_only {
            println!("  skip  write test: the disk is read-only");
        } else {
            let sector = a
                .scratch_sector
                .unwrap_or(info.capacity.saturating_sub(128));
            if !sector.is_multiple_of(per_block) {
                return Err(format!(
                    "--scratch-sector {sector}: give a multiple of {per_block} (the disk has \
                     {bs}-byte blocks; sectors are 512 bytes)"
                ));
            }
            write_test(&mut d, &buf, sector, &mut rep);
        }
    } else {
        println!("  skip  write test (use --write: writes a scratch range, then restores it)");
    }
    let _ = d.shutdown();
    Ok(rep.verdict("selftest"))
}

/// Reads `n` units of `unit` bytes from sector 0 into `buf` at `at`, 32 at a time.
fn batch_read(
    d: &mut VirtioBlk,
    buf: &outboard_hw::DmaBuf,
    n: u64,
    unit: u64,
    at: u64,
) -> Result<Vec<u8>, String> {
    let reqs = (0..n)
        .map(|i| {
            Ok(BlkRequest {
                op: BlkOp::Read,
                sector: i * unit / 512,
                bufs: vec![(
                    buf.iova_at(at + i * unit, unit)
                        .map_err(|e| e.to_string())?,
                    unit as u32,
                )],
                tag: i,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let done = d.execute_batch(0, &reqs, 32).map_err(|e| e.to_string())?;
    if let Some(c) = done.iter().find(|c| c.result.is_err()) {
        return Err(format!("request {} failed: {:?}", c.tag, c.result));
    }
    let mut out = vec![0u8; (n * unit) as usize];
    buf.read(at, &mut out).map_err(|e| e.to_string())?;
    Ok(out)
}

fn write_test(d: &mut VirtioBlk, buf: &outboard_hw::DmaBuf, sector: u64, rep: &mut Report) {
    const LEN: u32 = 64 << 10;
    let (orig, pat, chk) = (0u64, LEN as u64, 2 * LEN as u64);
    let e = |e: outboard_drivers::virtio_blk::BlkError| e.to_string();
    let saved = rep.step(&format!("save 64 KiB at sector {sector}"), || {
        d.read(sector, buf, orig, LEN).map_err(e)?;
        Ok(((), String::new()))
    });
    if saved.is_none() {
        return;
    }
    let pattern: Vec<u8> = (0..LEN as usize)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add((i >> 9) as u8))
        .collect();
    let compare = |buf: &outboard_hw::DmaBuf, at: u64, want: &[u8]| -> Result<(), String> {
        let mut got = vec![0u8; want.len()];
        buf.read(at, &mut got).map_err(|e| e.to_string())?;
        match got.iter().zip(want).position(|(a, b)| a != b) {
            None => Ok(()),
            Some(i) => Err(format!(
                "byte {i} differs: wrote {:#04x}, read {:#04x}",
                want[i], got[i]
            )),
        }
    };
    rep.step("write pattern, flush", || {
        buf.write(pat, &pattern).map_err(|e| e.to_string())?;
        d.write(sector, buf, pat, LEN).map_err(e)?;
        d.flush().map_err(e)?;
        Ok(((), String::new()))
    });
    rep.step("read back, compare", || {
        buf.fill(chk, LEN as usize, 0).map_err(|e| e.to_string())?;
        d.read(sector, buf, chk, LEN).map_err(e)?;
        compare(buf, chk, &pattern)?;
        Ok(((), "identical".into()))
    });
    rep.step("restore original bytes, verify", || {
        d.write(sector, buf, orig, LEN).map_err(e)?;
        d.flush().map_err(e)?;
        d.read(sector, buf, chk, LEN).map_err(e)?;
        let mut original = vec![0u8; LEN as usize];
        buf.read(orig, &mut original).map_err(|e| e.to_string())?;
        compare(buf, chk, &original)?;
        Ok(((), "restored".into()))
    });
}

/// An IOVA inside a 39-bit IOMMU address space that `DmaSpace` never hands out (it allocates
/// from 4 GiB upwards, far below this).
const UNMAPPED_IOVA: u64 = 0x40_0000_0000;

fn dma_fault(spec: &DeviceSpec) -> Result<ExitCode, String> {
    let f = PciFunction::open(spec).map_err(|e| e.to_string())?;
    let mut d = VirtioBlk::new(f, BlkDriverOptions::default()).map_err(|e| e.to_string())?;
    let r = BlkRequest {
        op: BlkOp::Read,
        sector: 0,
        bufs: vec![(UNMAPPED_IOVA, 4096)],
        tag: 1,
    };
    d.submit(0, &r).map_err(|e| e.to_string())?;
    d.kick(0).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    match d.wait(0, &mut out, std::time::Duration::from_secs(3)) {
        Ok(_) if !out.is_empty() => println!("read into unmapped IOVA {UNMAPPED_IOVA:#x}: {:?}", out[0].result),
        Ok(_) | Err(_) => println!("read into unmapped IOVA {UNMAPPED_IOVA:#x}: no completion (the device gave up on the request)"),
    }
    Ok(ExitCode::SUCCESS)
}
