//! Outboard's drivers, unchanged, drive QEMU's own devices through real Linux VFIO inside a QEMU
//! guest (TCG, q35, emulated Intel IOMMU, Debian's kernel booted through its PVH entry).
//!
//! The guest runs `outboard hw probe` on QEMU's virtio-blk-pci, nvme, virtio-net-pci and e1000,
//! reads random bytes from QEMU's virtio-rng-pci through a driver server and a session,
//! sends frames between two of QEMU's virtio-net-pci NICs on a QEMU hub through the net class,
//! `outboard hw selftest --write` on virtio-blk-pci (512-byte and 4 KiB logical blocks), runs
//! the block class's conformance suite there through the native driver and through the
//! `virtio-drivers` crate's driver hosted unmodified (`--suite`, both block sizes), checks
//! that a virtio-blk-pci without ACCESS_PLATFORM is refused at bring-up, that a driver server
//! on a VFIO device, once confined, is refused every escape, and checks the IOMMU: no DMAR fault in a
//! normal run, one when a read targets an unmapped IOVA. Needs qemu-system-x86, busybox-static,
//! cpio and Debian's kernel package, which `test.sh` installs and `scripts/guest/prepare.sh`
//! fetches.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in irqbypass vfio vfio_iommu_type1 vfio_virqfd vfio-pci-core vfio-pci; do insmod /mod/$m.ko || echo "GUEST insmod $m failed"; done
bind() { # vendor:device → BDF, bound to vfio-pci
  for d in /sys/bus/pci/devices/*; do
    if [ "$(cat $d/vendor):$(cat $d/device)" = "$1" ]; then
      echo vfio-pci > $d/driver_override
      [ -e $d/driver ] && echo $(basename $d) > $d/driver/unbind
      echo $(basename $d) > /sys/bus/pci/drivers_probe
      basename $d; return
    fi
  done
}
bdf() { # BDF → bound to vfio-pci
  d=/sys/bus/pci/devices/$1
  echo vfio-pci > $d/driver_override
  [ -e $d/driver ] && echo $1 > $d/driver/unbind
  echo $1 > /sys/bus/pci/drivers_probe
}
faults() { dmesg | grep -c -E "DMAR: \[DMA (Read|Write)|DMAR: DRHD: handling fault" ; }
BLK=$(bind 0x1af4:0x1042); NVME=$(bind 0x1b36:0x0010); NET=$(bind 0x1af4:0x1041); E1000=$(bind 0x8086:0x100e)
echo "GUEST devices blk=$BLK nvme=$NVME net=$NET e1000=$E1000"
for d in $BLK $NVME $NET $E1000; do echo "GUEST probe $d"; /outboard hw probe --vfio $d 2>&1; echo "GUEST probe-rc $?"; done
/outboard -vv hw selftest --write --vfio $BLK 2>&1; echo "GUEST selftest-rc $?"
/outboard hw selftest --write --driver virtio-drivers-blk --vfio $BLK 2>&1; echo "GUEST vdrivers-rc $?"
/outboard hw selftest --suite --vfio $BLK 2>&1; echo "GUEST suite-rc $?"
/outboard hw selftest --suite --driver virtio-drivers-blk --vfio $BLK 2>&1; echo "GUEST suite-vdrivers-rc $?"
/outboard driver-host --listen /blk.sock --device d=vfio:$BLK --check-confinement /init /none.sock 1 2>&1; echo "GUEST confine-rc $?"
bdf 0000:00:06.0; bdf 0000:00:07.0
echo "GUEST noplat-t0 $(cut -d' ' -f1 /proc/uptime)"
/outboard hw selftest --vfio 0000:00:06.0 2>&1; echo "GUEST noplat-rc $?"
echo "GUEST noplat-t1 $(cut -d' ' -f1 /proc/uptime)"
/outboard hw selftest --write --vfio 0000:00:07.0 2>&1; echo "GUEST blk4k-rc $?"
/outboard hw selftest --suite --vfio 0000:00:07.0 2>&1; echo "GUEST suite4k-rc $?"
/outboard hw selftest --suite --driver virtio-drivers-blk --vfio 0000:00:07.0 2>&1; echo "GUEST suite4k-vdrivers-rc $?"
RNG=$(bind 0x1af4:0x1044); echo "GUEST rng-device $RNG"
/outboard driver-host --listen /rng.sock --device rng=vfio:$RNG > /rng.log 2>&1 &
i=0; while [ ! -S /rng.sock ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
echo "GUEST rng-a $(/outboard rng read rng --server /rng.sock --length 64 --hex 2>&1)"
echo "GUEST rng-b $(/outboard rng read rng --server /rng.sock --length 64 --hex 2>&1)"
echo "GUEST rng-big $(/outboard rng read rng --server /rng.sock --length 200000 | wc -c)"
cat /rng.log
bdf 0000:00:09.0
/outboard driver-host --listen /net.sock --device nic0=vfio:$NET --device nic1=vfio:0000:00:09.0 > /net.log 2>&1 &
i=0; while [ ! -S /net.sock ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
/outboard net recv nic1 --server /net.sock --count 3 --hex --timeout 20s > /recv.out 2>&1 &
RECV=$!
i=0; while ! grep -q listening /recv.out && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
/outboard net send nic0 --server /net.sock --payload outboard-over-qemu --count 3 2>&1
wait $RECV; echo "GUEST net-recv-rc $?"
sed 's/^/GUEST net-recv /' /recv.out
echo "GUEST net-stats $(/outboard net stats nic1 --server /net.sock --json | tr -d ' \n')"
cat /net.log
drv() { basename "$(readlink /sys/bus/pci/devices/$1/driver)"; }
echo "GUEST hwlist-begin"; /outboard hw list 2>&1; echo "GUEST hwlist-rc $?"
echo "GUEST hwlist-json $(/outboard hw list --json | tr -d ' \n')"
insmod /mod/e1000.ko || echo "GUEST insmod e1000 failed"
F=0000:00:0a.0; i=0; while [ ! -d /sys/bus/pci/devices/$F/net ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
echo "GUEST e1000-before $(drv $F) $(drv $E1000)"
IF=$(ls /sys/bus/pci/devices/$F/net); ip link set $IF up
/outboard hw bind $F 2>&1; echo "GUEST bind-inuse-rc $?"
echo "GUEST e1000-refused $(drv $F)"
ip link set $IF down
/outboard hw bind $F 2>&1; echo "GUEST bind-rc $?"
echo "GUEST e1000-bound $(drv $F)"
/outboard hw probe --vfio $F 2>&1 | head -2
/outboard hw unbind $RNG 2>&1; echo "GUEST unbind-open-rc $?"
/outboard hw unbind $F 2>&1; echo "GUEST unbind-rc $?"
echo "GUEST e1000-restored $(drv $F) $(ls /sys/bus/pci/devices/$F/net)"
printf '[[device]]\nname = "nic9"\npci = "0000:00:0a.0"\n' > /m2.toml
/outboard up --machine /m2.toml --runtime-dir /run/ob2 --control /run/ob2/c.sock 2>&1; echo "GUEST up-kernel-rc $?"
bdf 0000:00:0c.0; bdf 0000:00:0c.1
printf '[[device]]\nname = "mf0"\npci = "0000:00:0c.0"\n[[device]]\nname = "mf1"\npci = "0000:00:0c.1"\n' > /m5.toml
/outboard up --machine /m5.toml --runtime-dir /run/ob5 --control /run/ob5/c.sock 2>&1; echo "GUEST up-group-rc $?"
printf '[[device]]\nname = "nic8"\npci = "%s"\n' $E1000 > /m3.toml
/outboard up --machine /m3.toml --runtime-dir /run/ob3 --control /run/ob3/c.sock 2>&1; echo "GUEST up-nodriver-rc $?"
PBLK=0000:01:00.0; bdf $PBLK
mkdir -p /run/ob; export OUTBOARD_CONTROL=/run/ob/control.sock
printf '[[device]]\nname = "mem0"\nmodel = "virtio-blk"\nbacking = "mem:4M"\nserver = "shared"\n[[device]]\nname = "disk0"\npci = "%s"\nserver = "shared"\n[[export]]\ndevice = "disk0"\nsocket = "/run/ob/d0.nbd"\n' $PBLK > /m.toml
/outboard up -v --machine /m.toml --runtime-dir /run/ob > /up.log 2>&1 &
UP=$!
i=0; while ! /outboard blk info disk0 > /dev/null 2>&1 && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
/outboard ls 2>&1 | sed 's/^/GUEST ls /'
server() { /outboard ls | grep "driver virtio-blk" | grep "state=running" | head -1 | sed -n 's/.*[<, ]pid=\([0-9]*\).*/\1/p'; }
echo "GUEST server-line $(tr '\0' ' ' < /proc/$(server)/cmdline)"
( ok=0; bad=0; for r in $(seq 1 12); do head -c 262144 /dev/urandom > /v$r
    /outboard blk write disk0 --offset $((r*262144)) -i /v$r --timeout 60s || bad=$((bad+1))
    /outboard blk read disk0 --offset $((r*262144)) --length 262144 -o /r$r --timeout 60s || bad=$((bad+1))
    if cmp -s /v$r /r$r; then ok=$((ok+1)); else bad=$((bad+1)); fi; rm -f /v$r /r$r
  done; echo "GUEST verified $ok $bad" ) > /verify.out 2>&1 &
V=$!
# Each kill lands on a server that serves (a new pid, running): every incarnation got as far
# as claiming its function.
k=0; LAST=; while kill -0 $V 2>/dev/null && [ $k -lt 5 ]; do sleep 0.7; S=$(server)
  [ -n "$S" ] && [ "$S" != "$LAST" ] && kill -9 $S && k=$((k+1)) && LAST=$S; done
i=0; while [ -z "$(server)" ] || [ "$(server)" = "$LAST" ]; do [ $i -ge 100 ] && break; sleep 0.1; i=$((i+1)); done
wait $V; cat /verify.out; echo "GUEST kills $k"
/outboard ls 2>&1 | sed 's/^/GUEST ls2 /'
echo "GUEST resets $(cat /run/ob/*.log | grep -c 'reset (VFIO_DEVICE_RESET) before use')"
head -c 4096 /dev/urandom > /mark; /outboard blk write disk0 -i /mark > /dev/null
/outboard power disk0 suspend 2>&1; echo "GUEST suspend-rc $?"
/outboard power disk0 resume 2>&1; echo "GUEST resume-rc $?"
/outboard blk write mem0 -i /mark > /dev/null; /outboard blk read mem0 --length 4096 -o /memback
cmp -s /mark /memback && echo "GUEST mem0-same yes"
NBD="nbd+unix:///disk0?socket=/run/ob/d0.nbd"
/outboard blk read "$NBD" --length 4096 -o /nbdback 2>&1; cmp -s /mark /nbdback && echo "GUEST nbd-read-same yes"
head -c 8192 /dev/urandom > /mark2; /outboard blk write "$NBD" --offset 65536 -i /mark2 2>&1
/outboard blk read disk0 --offset 65536 --length 8192 -o /back3; cmp -s /mark2 /back3 && echo "GUEST nbd-write-same yes"
/outboard down 2>&1; wait $UP; echo "GUEST up-rc $?"
printf '[[device]]\nname = "disk0"\npci = "%s"\n' $PBLK > /m4.toml
/outboard up --machine /m4.toml --runtime-dir /run/ob > /up4.log 2>&1 &
UP=$!
i=0; while ! /outboard blk info disk0 > /dev/null 2>&1 && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
/outboard detach disk0 2>&1; echo "GUEST detach-rc $?"
/outboard attach disk0 > /dev/null 2>&1; echo "GUEST attach-rc $?"
/outboard blk read disk0 --length 4096 -o /back; cmp -s /mark /back && echo "GUEST reattached-same yes"
/outboard detach disk0 --unbind 2>&1; echo "GUEST detach-unbind-rc $?"
echo "GUEST pblk-after-unbind $([ -e /sys/bus/pci/devices/$PBLK/driver ] && drv $PBLK || echo none)"
/outboard hw bind $PBLK > /dev/null 2>&1
/outboard attach --pci $PBLK 2>&1; echo "GUEST attach-pci-again-rc $?"
/outboard attach disk0 > /dev/null 2>&1; echo "GUEST attach-rebound-rc $?"
/outboard blk read disk0 --length 4096 -o /back2; cmp -s /mark /back2 && echo "GUEST attach-rebound-same yes"
/outboard detach disk0 2>&1
/outboard attach --pci 0000:00:07.0 > /attach.out 2>&1; echo "GUEST attach-pci-rc $?"; head -2 /attach.out
/outboard blk info pci00-07-0 2>&1 | head -3; echo "GUEST attach-pci-info-rc $?"
/outboard detach disk1 --unbind 2>&1; echo "GUEST detach-nonpci-rc $?"
/outboard down 2>&1; wait $UP; echo "GUEST up4-rc $?"
grep -i -E "error|refus" /up.log | head -5
echo "GUEST faults-normal $(faults)"
/outboard hw dma-fault --vfio $BLK 2>&1
sleep 1
echo "GUEST faults-bad $(faults)"
dmesg | grep DMAR | tail -3
echo GUEST-DONE
poweroff -f
"#;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Builds a gzip'ed newc initramfs: busybox, the VFIO modules, `outboard` (stripped) and the
/// shared libraries it needs, and the init script above.
fn initramfs(kernel_dir: &Path, work: &Path, init: &str) -> PathBuf {
    let ir = work.join("ir");
    for d in [
        "bin",
        "mod",
        "proc",
        "sys",
        "dev",
        "lib64",
        "lib/x86_64-linux-gnu",
    ] {
        std::fs::create_dir_all(ir.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", ir.join("bin/busybox")).expect("busybox-static is installed");
    for m in std::fs::read_dir(kernel_dir.join("modules")).unwrap() {
        let m = m.unwrap().path();
        std::fs::copy(&m, ir.join("mod").join(m.file_name().unwrap())).unwrap();
    }
    let exe = env!("CARGO_BIN_EXE_outboard");
    let st = Command::new("strip")
        .arg("-o")
        .arg(ir.join("outboard"))
        .arg(exe)
        .status()
        .unwrap();
    assert!(st.success(), "strip");
    let ldd = Command::new("ldd").arg(exe).output().unwrap();
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        let path = line
            .split_whitespace()
            .find(|w| w.starts_with('/'))
            .map(PathBuf::from);
        if let Some(p) = path {
            let dst = ir.join(p.strip_prefix("/").unwrap());
            std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
            std::fs::copy(&p, &dst).unwrap();
        }
    }
    std::fs::write(ir.join("init"), init).unwrap();
    Command::new("chmod")
        .args(["+x"])
        .arg(ir.join("init"))
        .status()
        .unwrap();
    let out = work.join("initrd.gz");
    let sh = format!(
        "cd {} && find . | cpio -o -H newc 2>/dev/null | gzip -1 > {}",
        ir.display(),
        out.display()
    );
    assert!(
        Command::new("sh")
            .args(["-c", &sh])
            .status()
            .unwrap()
            .success(),
        "cpio"
    );
    out
}

/// The guest kernel and its modules (`scripts/guest/prepare.sh`). One test at a time
/// prepares them: on a fresh machine the first fetches and unpacks the kernel package into
/// `target/guest`, and a second one beside it would read the half-unpacked directory.
fn guest_kernel() -> PathBuf {
    static PREPARING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = PREPARING.lock().unwrap_or_else(|p| p.into_inner());
    let prep = Command::new(root().join("scripts/guest/prepare.sh"))
        .arg(root().join("target/guest"))
        .output()
        .expect("run prepare.sh");
    assert!(
        prep.status.success(),
        "preparing the guest kernel failed (run ./test.sh, which installs what it needs):\n{}",
        String::from_utf8_lossy(&prep.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&prep.stdout).trim())
}

/// Runs QEMU to its end, within `limit` (then it is killed): what it printed.
fn run_qemu(qemu: std::process::Child, limit: Duration) -> std::process::Output {
    // The watchdog kills QEMU only if it is still running (told otherwise before its pid is
    // reaped and free).
    let pid = qemu.id();
    let (finished, wait) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(limit) {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
        }
    });
    let out = qemu.wait_with_output().unwrap();
    drop(finished);
    let _ = watchdog.join();
    out
}

/// The guest for QEMU's pci-serial: the C 16550 driver in a driver server on it through VFIO
/// sends a line out of QEMU's chardev, and what the host sends back is read by a client; then
/// the char class's conformance suite runs with the host side of the chardev echoing, with the
/// legacy driver (on osenv) and again with the native one (native.h) in a new server.
const SERIAL_INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in irqbypass vfio vfio_iommu_type1 vfio_virqfd vfio-pci-core vfio-pci; do insmod /mod/$m.ko || echo "GUEST insmod $m failed"; done
for d in /sys/bus/pci/devices/*; do
  if [ "$(cat $d/vendor):$(cat $d/device)" = "0x1b36:0x0002" ]; then
    echo vfio-pci > $d/driver_override
    [ -e $d/driver ] && echo $(basename $d) > $d/driver/unbind
    echo $(basename $d) > /sys/bus/pci/drivers_probe
    SER=$(basename $d)
  fi
done
echo "GUEST ser-device $SER"
/outboard -v driver-host --listen /ser.sock --device ser=vfio:$SER > /ser.log 2>&1 &
HOST=$!
i=0; while [ ! -S /ser.sock ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done
/outboard char write ser --server /ser.sock from-guest --crlf 2>&1; echo "GUEST ser-write-rc $?"
echo "GUEST ser-read $(/outboard char read ser --server /ser.sock --length 9 --idle 60s 2>&1)"
echo "GUEST ser-info $(/outboard char info ser --server /ser.sock 2>&1 | tr '
' ' ')"
/outboard char set ser --server /ser.sock 9600,7E2 2>&1; echo "GUEST ser-set-rc $?"
echo "GUEST ser-info2 $(/outboard char info ser --server /ser.sock 2>&1 | tr '
' ' ')"
/outboard char set ser --server /ser.sock 115200,8N1 2>&1; echo "GUEST ser-reset-rc $?"
seq 1 800 | /outboard char write ser --server /ser.sock 2>&1; echo "GUEST ser-burst-out-rc $?"
/outboard char read ser --server /ser.sock --length 1892 --idle 60s > /in.txt 2>/in.err; echo "GUEST ser-burst-in-rc $?"
seq 1 500 > /want.txt
cmp /in.txt /want.txt > /dev/null && echo "GUEST ser-burst-in same" || echo "GUEST ser-burst-in differs: $(wc -c < /in.txt) bytes $(head -c 200 /in.err)"
/outboard char selftest ser --server /ser.sock > /suite.txt 2>&1; echo "GUEST ser-suite-rc $?"
sed 's/^/GUEST ser-suite /' /suite.txt
sed 's/^/GUEST ser-log /' /ser.log
# The same device, its legacy driver's server ended, driven by the native C driver.
kill $HOST; i=0; while kill -0 $HOST 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
rm -f /ser.sock
/outboard -v driver-host --listen /ser.sock --device ser=vfio:$SER --driver ser=native-c-uart16550 > /nser.log 2>&1 &
i=0; while [ ! -S /ser.sock ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done
echo "GUEST nser-info $(/outboard char info ser --server /ser.sock 2>&1 | tr '
' ' ')"
/outboard char selftest ser --server /ser.sock > /nsuite.txt 2>&1; echo "GUEST nser-suite-rc $?"
sed 's/^/GUEST nser-suite /' /nsuite.txt
sed 's/^/GUEST nser-log /' /nser.log
echo GUEST-DONE
poweroff -f
"#;

#[test]
fn the_c_16550_driver_drives_qemus_pci_serial_through_vfio_in_a_guest() {
    let kernel_dir = guest_kernel();
    let work = tempfile::tempdir().unwrap();
    let initrd = initramfs(&kernel_dir, work.path(), SERIAL_INIT);
    let chardev = work.path().join("ser.sock");
    let qemu = Command::new("qemu-system-x86_64")
        .args([
            "-accel",
            "tcg",
            "-machine",
            "q35,kernel-irqchip=split",
            "-m",
            "512",
            "-nographic",
            "-no-reboot",
            "-nodefaults",
            "-serial",
            "stdio",
        ])
        .args(["-device", "intel-iommu,intremap=on,caching-mode=on"])
        .arg("-kernel")
        .arg(kernel_dir.join("vmlinux"))
        .arg("-initrd")
        .arg(&initrd)
        .args([
            "-append",
            "console=ttyS0 intel_iommu=on quiet panic=-1 no_timer_check",
        ])
        // QEMU's own 16550 on PCI; its line is a socket this test connects to.
        .arg("-chardev")
        .arg(format!(
            "socket,id=ser1,path={},server=on,wait=off",
            chardev.display()
        ))
        .args(["-device", "pci-serial,chardev=ser1,addr=0x5"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("qemu-system-x86_64 is installed");
    // The host side of QEMU's chardev: waits for the guest's line, then answers.
    let host = std::thread::spawn(move || -> Result<Vec<u8>, String> {
        use std::io::Read;
        let deadline = Instant::now() + Duration::from_secs(200);
        let mut s = loop {
            match std::os::unix::net::UnixStream::connect(&chardev) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Err(e) => return Err(format!("{}: {e}", chardev.display())),
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        while !got.ends_with(b"\r\n") && Instant::now() < deadline {
            match s.read(&mut buf) {
                Ok(0) => return Err(format!("the chardev closed after {got:?}")),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(_) => {}
            }
        }
        s.write_all(b"from-host").map_err(|e| e.to_string())?;
        // A burst far larger than the 16-byte FIFOs each way: the guest sends `seq 1 800`,
        // and once it is all here, it is answered with `seq 1 500`.
        let burst: Vec<u8> = (1..=800)
            .flat_map(|i| format!("{i}\n").into_bytes())
            .collect();
        let mut came = Vec::new();
        while came.len() < burst.len() && Instant::now() < deadline {
            match s.read(&mut buf) {
                Ok(0) => {
                    return Err(format!(
                        "the chardev closed after {} burst bytes",
                        came.len()
                    ))
                }
                Ok(n) => came.extend_from_slice(&buf[..n]),
                Err(_) => {}
            }
        }
        if came != burst {
            return Err(format!(
                "the guest's burst: {} bytes came, not the {} of seq 1 800",
                came.len(),
                burst.len()
            ));
        }
        let answer: Vec<u8> = (1..=500)
            .flat_map(|i| format!("{i}\n").into_bytes())
            .collect();
        s.write_all(&answer).map_err(|e| e.to_string())?;
        // Then the line is looped back for the conformance suite, until QEMU ends (the
        // chardev closes) or the guest's time is up.
        let stop = std::sync::atomic::AtomicBool::new(false);
        let line: std::os::fd::OwnedFd = s.into();
        outboard_devices::serial_line::echo(&line, &stop).map_err(|e| e.to_string())?;
        Ok(got)
    });
    let t0 = Instant::now();
    let out = run_qemu(qemu, Duration::from_secs(240));
    let log = String::from_utf8_lossy(&out.stdout).into_owned();
    let _ = std::io::stderr()
        .write_all(format!("guest ran {:.1} s\n", t0.elapsed().as_secs_f64()).as_bytes());
    assert!(
        log.contains("GUEST-DONE"),
        "the guest did not finish:\n{log}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |key: &str| {
        log.lines()
            .find_map(|l| l.strip_prefix(&format!("GUEST {key} ")))
            .unwrap_or_else(|| panic!("no {key} in:\n{log}"))
            .trim()
            .to_string()
    };
    // Bytes written by the driver arrive on the host side of QEMU's chardev ...
    assert_eq!(field("ser-write-rc"), "0", "{log}");
    assert_eq!(host.join().unwrap().unwrap(), b"from-guest\r\n", "{log}");
    // ... and bytes fed in arrive at an Outboard client.
    assert_eq!(field("ser-read"), "from-host", "{log}");
    let info = field("ser-info");
    assert!(info.contains("115200 baud 8N1"), "{info}");
    // Line settings reach QEMU's 16550 (the driver reads the divisor and LCR back and fails
    // the call if the device kept others) ...
    assert_eq!(field("ser-set-rc"), "0", "{log}");
    assert!(field("ser-info2").contains("9600 baud 7E2"), "{log}");
    assert_eq!(field("ser-reset-rc"), "0", "{log}");
    // ... and bursts far larger than its FIFOs cross both ways whole and in order.
    assert_eq!(field("ser-burst-out-rc"), "0", "{log}");
    assert_eq!(field("ser-burst-in-rc"), "0", "{log}");
    assert_eq!(field("ser-burst-in"), "same", "{log}");
    assert!(info.contains("sent 12 bytes, received 9"), "{info}");
    assert!(log.contains("uart16550"), "{log}");
    // The class's conformance suite passes on QEMU's 16550 through VFIO.
    for l in log.lines().filter(|l| l.starts_with("GUEST ser-suite ")) {
        let _ = writeln!(std::io::stderr(), "{l}");
    }
    assert_eq!(field("ser-suite-rc"), "0", "{log}");
    let suite_passed = |prefix: &str| {
        for c in outboard_char::conformance::CHECKS {
            assert!(
                log.lines()
                    .any(|l| l.starts_with(prefix) && l.contains(c.name) && l.contains(" ok ")),
                "{prefix} {}: {log}",
                c.name
            );
        }
    };
    suite_passed("GUEST ser-suite ");
    // The native C driver (native.h) on the same device passes it too.
    for l in log.lines().filter(|l| l.starts_with("GUEST nser-suite ")) {
        let _ = writeln!(std::io::stderr(), "{l}");
    }
    assert!(field("nser-info").contains("115200 baud 8N1"), "{log}");
    assert!(
        log.contains("native-c-uart16550: a 16550A on I/O BAR 0"),
        "the native driver did not drive it: {log}"
    );
    assert_eq!(field("nser-suite-rc"), "0", "{log}");
    suite_passed("GUEST nser-suite ");
}

#[test]
fn outboard_drives_qemus_devices_through_vfio_in_a_guest() {
    let kernel_dir = guest_kernel();
    let work = tempfile::tempdir().unwrap();
    let initrd = initramfs(&kernel_dir, work.path(), INIT);
    let disk = work.path().join("disk.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let disk2 = work.path().join("noplat.img");
    let disk3 = work.path().join("blk4k.img");
    let disk4 = work.path().join("pcie.img");
    let disk5 = work.path().join("mf0.img");
    let disk6 = work.path().join("mf1.img");
    for d in [&disk2, &disk3, &disk4, &disk5, &disk6] {
        std::fs::File::create(d).unwrap().set_len(16 << 20).unwrap();
    }
    let nvme = work.path().join("nvme.img");
    std::fs::File::create(&nvme)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();

    let t0 = Instant::now();
    let qemu = Command::new("qemu-system-x86_64")
        .args([
            "-accel",
            "tcg",
            "-machine",
            "q35,kernel-irqchip=split",
            "-m",
            "1024",
            "-smp",
            "2",
            "-nographic",
            "-no-reboot",
            "-nodefaults",
            "-serial",
            "stdio",
        ])
        .args(["-device", "intel-iommu,intremap=on,caching-mode=on"])
        .arg("-kernel")
        .arg(kernel_dir.join("vmlinux"))
        .arg("-initrd")
        .arg(&initrd)
        .args([
            "-append",
            "console=ttyS0 intel_iommu=on quiet panic=-1 no_timer_check",
        ])
        .arg("-drive")
        .arg(format!("file={},if=none,id=blk,format=raw", disk.display()))
        .args([
            "-device",
            "virtio-blk-pci,drive=blk,disable-legacy=on,iommu_platform=on",
        ])
        // Without ACCESS_PLATFORM: it would DMA around the IOMMU, so it must be refused.
        .arg("-drive")
        .arg(format!(
            "file={},if=none,id=noplat,format=raw",
            disk2.display()
        ))
        .args([
            "-device",
            "virtio-blk-pci,drive=noplat,disable-legacy=on,iommu_platform=off,addr=0x6",
        ])
        // 4 KiB logical blocks: every request in whole 4 KiB blocks.
        .arg("-drive")
        .arg(format!(
            "file={},if=none,id=blk4k,format=raw",
            disk3.display()
        ))
        .args([
            "-device",
            "virtio-blk-pci,drive=blk4k,disable-legacy=on,iommu_platform=on,addr=0x7,\
             logical_block_size=4096,physical_block_size=4096",
        ])
        .arg("-drive")
        .arg(format!("file={},if=none,id=nv,format=raw", nvme.display()))
        .args(["-device", "nvme,drive=nv,serial=outboard"])
        // Two of QEMU's NICs on one QEMU hub: what one sends, the other receives.
        .args([
            "-netdev",
            "hubport,id=n0,hubid=1",
            "-device",
            "virtio-net-pci,netdev=n0,disable-legacy=on,iommu_platform=on",
            "-netdev",
            "hubport,id=n2,hubid=1",
            "-device",
            "virtio-net-pci,netdev=n2,disable-legacy=on,iommu_platform=on,addr=0x9",
        ])
        // Two functions of one multifunction slot: one IOMMU group.
        .arg("-drive")
        .arg(format!("file={},if=none,id=mf0,format=raw", disk5.display()))
        .arg("-drive")
        .arg(format!("file={},if=none,id=mf1,format=raw", disk6.display()))
        .args([
            "-device",
            "virtio-blk-pci,drive=mf0,disable-legacy=on,iommu_platform=on,addr=0xc.0,multifunction=on",
            "-device",
            "virtio-blk-pci,drive=mf1,disable-legacy=on,iommu_platform=on,addr=0xc.1",
        ])
        // A virtio disk behind a PCIe root port: a PCIe endpoint with FLR, so VFIO can reset
        // it (the functions on the root complex above have no reset VFIO offers).
        .arg("-drive")
        .arg(format!(
            "file={},if=none,id=pblk,format=raw",
            disk4.display()
        ))
        .args([
            "-device",
            "pcie-root-port,id=rp1,chassis=1,addr=0xb",
            "-device",
            "virtio-blk-pci,drive=pblk,bus=rp1,disable-legacy=on,iommu_platform=on",
        ])
        .args([
            "-netdev",
            "user,id=n1,restrict=on",
            "-device",
            "e1000,netdev=n1",
            // A second e1000 that the guest kernel's e1000 driver takes: `hw bind` moves it
            // to vfio-pci and `hw unbind` gives it back.
            "-netdev",
            "user,id=n3,restrict=on",
            "-device",
            "e1000,netdev=n3,addr=0xa",
        ])
        // QEMU's entropy device, backed by the host's /dev/urandom.
        .args([
            "-object",
            "rng-random,id=rng0,filename=/dev/urandom",
            "-device",
            "virtio-rng-pci,rng=rng0,disable-legacy=on,iommu_platform=on",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("qemu-system-x86_64 is installed");
    // Bound the run: a hung guest fails the test instead of hanging it.
    let out = run_qemu(qemu, Duration::from_secs(240));
    let log = String::from_utf8_lossy(&out.stdout).into_owned();
    let _ = std::io::stderr()
        .write_all(format!("guest ran {:.1} s\n", t0.elapsed().as_secs_f64()).as_bytes());
    assert!(
        log.contains("GUEST-DONE"),
        "the guest did not finish:\n{log}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!log.contains("insmod") || !log.contains("failed"), "{log}");
    let field = |key: &str| {
        log.lines()
            .find_map(|l| l.strip_prefix(&format!("GUEST {key} ")))
            .unwrap_or_else(|| panic!("no {key} in:\n{log}"))
            .trim()
            .to_string()
    };
    // Each key's value as the guest printed it.
    let fields_are = |want: &[(&str, &str)]| {
        for (key, value) in want {
            assert_eq!(field(key), *value, "{key}:\n{log}");
        }
    };
    // Identity, BARs and MSI-X of every device, through VFIO.
    for (ids, what) in [
        ("1af4:1042", "virtio-blk"),
        ("1b36:0010", "nvme"),
        ("1af4:1041", "virtio-net"),
        ("8086:100e", "e1000"),
    ] {
        assert!(
            log.contains(&format!("  {ids}")),
            "{what} not probed:\n{log}"
        );
    }
    assert!(log.contains("driver: virtio-blk"), "{log}");
    assert!(
        log.contains("virtio notify"),
        "virtio capabilities decoded:\n{log}"
    );
    assert!(
        log.matches("MSI-X: ").count() >= 3,
        "MSI-X capabilities:\n{log}"
    );
    assert!(!log.contains("probe-rc 1"), "{log}");
    // The unchanged driver: verified writes, reads and flush on QEMU's virtio-blk-pci.
    assert_eq!(field("selftest-rc"), "0", "{log}");
    assert!(
        log.contains("selftest passed")
            && log.contains("read back, compare")
            && log.contains("MSI-X"),
        "{log}"
    );
    // The virtio-drivers crate's block driver, unmodified, on the same device through VFIO.
    assert_eq!(field("vdrivers-rc"), "0", "{log}");
    assert!(
        log.contains("bring-up of virtio-drivers-blk")
            && log.contains("write, flush, read back, compare"),
        "{log}"
    );
    // The same driver, started through VFIO and then confined, escapes nowhere.
    assert_eq!(field("confine-rc"), "0", "{log}");
    let n = outboard_confine::probe::count();
    assert!(
        log.contains(&format!("{n} of {n} attempts refused")),
        "{log}"
    );
    // A virtio device without ACCESS_PLATFORM is refused at bring-up, saying why, at once.
    assert_eq!(field("noplat-rc"), "1", "{log}");
    assert!(
        log.contains("does not offer VIRTIO_F_ACCESS_PLATFORM"),
        "{log}"
    );
    let t0: f64 = field("noplat-t0").parse().unwrap();
    let t1: f64 = field("noplat-t1").parse().unwrap();
    // At once: well inside the 30 s a request would wait before timing out (the bound is
    // loose because the guest runs under TCG beside other tests on two cores).
    assert!(t1 - t0 < 5.0, "refusing took {:.2} s:\n{log}", t1 - t0);
    // A disk with 4 KiB logical blocks passes the write self-test.
    assert_eq!(field("blk4k-rc"), "0", "{log}");
    assert!(log.contains("block size 4096"), "{log}");
    // The block class's conformance suite, the one the workspace's tests hold every block
    // driver to, passes on QEMU's virtio-blk-pci through VFIO with both drivers and both
    // block sizes (the hosted crate counts 512-byte sectors: its adapter gives the class the
    // device's 4 KiB block).
    for f in [
        "suite-rc",
        "suite-vdrivers-rc",
        "suite4k-rc",
        "suite4k-vdrivers-rc",
    ] {
        assert_eq!(field(f), "0", "{f}:\n{log}");
    }
    assert_eq!(log.matches("suite passed").count(), 4, "{log}");
    for driver in ["virtio-blk", "virtio-drivers-blk"] {
        for geometry in ["32768 blocks of 512 B", "4096 blocks of 4096 B"] {
            assert!(
                log.contains(&format!("{driver}: {geometry}")),
                "{driver}: {geometry}:\n{log}"
            );
        }
    }
    // The entropy class end to end on QEMU's virtio-rng-pci: the unchanged virtio-rng driver
    // in a driver server through VFIO, a client session, the bytes DMAed into its buffers.
    let (a, b) = (field("rng-a"), field("rng-b"));
    for r in [&a, &b] {
        assert_eq!(r.len(), 128, "64 bytes as hex: {r:?}\n{log}");
        assert!(r.chars().all(|c| c.is_ascii_hexdigit()), "{r:?}\n{log}");
    }
    assert_ne!(a, b, "two reads gave the same bytes:\n{log}");
    assert_ne!(a, "0".repeat(128), "{log}");
    assert_eq!(field("rng-big"), "200000", "{log}");
    // The net class end to end on QEMU's virtio-net-pci: two NICs on a QEMU hub, both driven
    // by Outboard's virtio-net driver in one driver server through VFIO; frames sent on one
    // arrive whole on the other, through a client session each.
    assert_eq!(field("net-recv-rc"), "0", "{log}");
    let payload: String = b"outboard-over-qemu"
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(log.matches(&payload).count(), 3, "{log}");
    assert!(log.contains("\"rx_delivered\":3"), "{log}");
    // The host's functions as `hw list` sees them: IOMMU groups, drivers, Outboard's match.
    assert_eq!(field("hwlist-rc"), "0", "{log}");
    let list = &log[log.find("GUEST hwlist-begin").unwrap()..log.find("GUEST hwlist-rc").unwrap()];
    assert!(
        list.lines().any(|l| l.contains("1af4:1042")
            && l.contains("vfio-pci")
            && l.contains("(viable)")
            && l.contains("virtio-blk (block, 1000)")),
        "{list}"
    );
    assert!(list.contains("IOMMU groups"), "{list}");
    let json: serde_json::Value = serde_json::from_str(&field("hwlist-json")).unwrap();
    let rng = json
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["device"] == "1044")
        .unwrap_or_else(|| panic!("{json}"));
    assert_eq!(rng["driver"], "vfio-pci", "{rng}");
    assert_eq!(rng["outboard_driver"]["class"], "entropy", "{rng}");
    assert_eq!(rng["viable"], true, "{rng}");
    // `hw bind` refuses the function whose interface is up and changes nothing, takes it
    // once the interface is down, and `hw unbind` gives it back to e1000 (its interface
    // back too); a function whose group a driver server holds open is not unbound.
    fields_are(&[("e1000-before", "e1000 vfio-pci"), ("bind-inuse-rc", "1")]);
    assert!(
        log.contains("in use by its kernel driver e1000: network interface eth0 is up"),
        "{log}"
    );
    fields_are(&[("e1000-refused", "e1000"), ("bind-rc", "0")]);
    assert!(
        log.contains("0000:00:0a.0 bound to vfio-pci (from e1000)"),
        "{log}"
    );
    assert_eq!(field("e1000-bound"), "vfio-pci", "{log}");
    // Probed through VFIO once bound (the first e1000 was probed at the start).
    assert_eq!(log.matches("  8086:100e  class 020000").count(), 2, "{log}");
    assert_eq!(field("unbind-open-rc"), "1", "{log}");
    assert!(
        log.contains("is open in ") && log.contains("): stop it first"),
        "{log}"
    );
    assert_eq!(field("unbind-rc"), "0", "{log}");
    assert_eq!(field("e1000-restored"), "e1000 eth0", "{log}");
    // QEMU's virtio-blk-pci, bound to vfio-pci, served by `outboard up` from a machine
    // description: on the registry's pci bus, and verified writes and reads ride through
    // SIGKILLs of its driver server with none failed and none wrong.
    let ls = log
        .lines()
        .filter_map(|l| l.strip_prefix("GUEST ls "))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        ls.contains("disk0@pci")
            && ls.contains("address=0000:01:00.0")
            && ls.contains("iommu-group"),
        "{ls}\n{log}"
    );
    assert!(ls.contains("virtio-blk"), "{ls}");
    // Its server was given the function's VFIO container and group: it opens no path.
    // It shares its server with a model's disk (grouped): the model's connection and the
    // function's container and group side by side.
    let line = field("server-line");
    assert!(
        line.contains("disk0=vfio-fd:")
            && line.contains("mem0=vfio-user-fd:")
            && !line.contains("=vfio:"),
        "{line}"
    );
    assert!(
        ls.contains("bus pci") && ls.contains("bus vfio-user"),
        "{ls}"
    );
    assert_eq!(field("verified"), "12 0", "{log}");
    let kills: u32 = field("kills").parse().unwrap();
    assert!(kills >= 2, "only {kills} kills landed:\n{log}");
    let ls2 = log
        .lines()
        .filter_map(|l| l.strip_prefix("GUEST ls2 "))
        .collect::<Vec<_>>()
        .join("\n");
    let restarts: u32 = ls2
        .split(", restarts=")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no restarts in {ls2}"));
    assert_eq!(restarts, kills, "each kill a restart: {ls2}");
    // Each server reset the function (FLR through VFIO) before it mapped anything: the first
    // and one per restart (the manager's probe logs elsewhere).
    let resets: u32 = field("resets").parse().unwrap();
    assert_eq!(resets, kills + 1, "resets for {kills} restarts:\n{log}");
    assert_eq!(field("up-rc"), "0", "{log}");
    // Hot-plug of a function: detached and attached again by name (the disk's bytes are its
    // own), detached and given back from vfio-pci (no guest driver takes it), bound again
    // and attached by address under a name of its own.
    fields_are(&[
        ("detach-rc", "0"),
        ("attach-rc", "0"),
        ("reattached-same", "yes"),
        ("detach-unbind-rc", "0"),
    ]);
    assert!(
        log.contains("0000:01:00.0 given back from vfio-pci"),
        "{log}"
    );
    assert_eq!(field("pblk-after-unbind"), "none", "{log}");
    // Once bound again: attach --pci of it is refused, naming the device it is, which
    // attaches by name with the same bytes; a function new to the machine attaches by address
    // under a name of its own.
    assert_eq!(field("attach-pci-again-rc"), "1", "{log}");
    assert!(
        log.contains("0000:01:00.0 is device disk0 already: `outboard attach disk0`"),
        "{log}"
    );
    fields_are(&[
        ("attach-rebound-rc", "0"),
        ("attach-rebound-same", "yes"),
        ("attach-pci-rc", "0"),
    ]);
    assert!(log.contains("block-device pci00-07-0"), "{log}");
    assert_eq!(field("up4-rc"), "0", "{log}");
    assert!(
        log.contains("--unbind: disk1 is not a PCI function of this machine; nothing was done"),
        "{log}"
    );
    assert_ne!(field("detach-nonpci-rc"), "0", "{log}");
    // Power: suspended and resumed like a model's disk; the grouped model's disk serves.
    assert_eq!(field("suspend-rc"), "0", "{log}");
    assert_eq!(field("resume-rc"), "0", "{log}");
    assert_eq!(field("mem0-same"), "yes", "{log}");
    // The export serves the function's disk over NBD: what the session wrote reads back
    // through it, and what is written through it reads back through the session.
    assert_eq!(field("nbd-read-same"), "yes", "{log}");
    assert_eq!(field("nbd-write-same"), "yes", "{log}");
    // Two devices whose functions share an IOMMU group are refused, naming both.
    assert_ne!(field("up-group-rc"), "0", "{log}");
    assert!(
        log.contains("mf1: 0000:00:0c.1 shares IOMMU group") && log.contains("with mf0's function"),
        "{log}"
    );
    // A function no Outboard driver matches is refused at `up`, naming it.
    assert_ne!(field("up-nodriver-rc"), "0", "{log}");
    assert!(
        log.contains("nic8: no driver matches 8086:100e (class 020000)"),
        "{log}"
    );
    // A function its kernel driver still holds is refused at `up`, saying what to do.
    assert_ne!(field("up-kernel-rc"), "0", "{log}");
    assert!(
        log.contains("nic9: 0000:00:0a.0 is bound to e1000, not vfio-pci: `outboard hw bind 0000:00:0a.0` hands it over"),
        "{log}"
    );
    // The IOMMU: silent in a normal run, a DMAR fault for an unmapped IOVA.
    assert_eq!(field("faults-normal"), "0", "{log}");
    let bad: u32 = field("faults-bad").parse().unwrap();
    assert!(bad > 0, "a DMA to an unmapped IOVA must fault:\n{log}");
    println!("{log}");
}
