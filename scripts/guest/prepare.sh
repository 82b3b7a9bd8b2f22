#!/usr/bin/env bash
# Prepares a Debian kernel for the QEMU guest tests: downloads the linux-image package the
# machine's apt would install, extracts the uncompressed vmlinux (booted through its PVH entry,
# the fast path), the VFIO modules and e1000 (a kernel driver for `hw bind` to take a
# function from). Idempotent; prints the directory it filled.
#   usage: scripts/guest/prepare.sh CACHE_DIR
set -euo pipefail
cache=${1:?usage: prepare.sh CACHE_DIR}
# One preparation at a time (two guest tests start together on a fresh machine).
mkdir -p "$cache"
exec 9>"$cache/.prepare.lock"
flock 9
pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
if [ -z "$pkg" ]; then
    apt-get update -qq >/dev/null
    pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
fi
[ -n "$pkg" ] || { echo "prepare.sh: cannot find Debian's kernel package" >&2; exit 1; }
dir="$cache/$pkg"
if [ -f "$dir/vmlinux" ] && [ -f "$dir/modules/vfio-pci.ko" ] && [ -f "$dir/modules/e1000.ko" ]; then
    echo "$dir"
    exit 0
fi
rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
(cd "$dir.tmp" && apt-get download "$pkg" >/dev/null 2>&1)
dpkg -x "$dir.tmp"/*.deb "$dir.tmp/root"
vmlinuz=$(ls "$dir.tmp"/root/boot/vmlinuz-*)
# The bzImage carries the kernel as an xz stream: find its magic and decompress from there.
off=$(grep -abo $'\xfd7zXZ\x00' "$vmlinuz" | head -1 | cut -d: -f1)
tail -c +$((off + 1)) "$vmlinuz" | xz -dc --single-stream > "$dir.tmp/vmlinux" 2>/dev/null || true
head -c 4 "$dir.tmp/vmlinux" | grep -q ELF || { echo "prepare.sh: no vmlinux in $vmlinuz" >&2; exit 1; }
mkdir -p "$dir.tmp/modules"
kdir=$(ls -d "$dir.tmp"/root/lib/modules/*/kernel)
for m in virt/lib/irqbypass.ko drivers/vfio/vfio.ko drivers/vfio/vfio_iommu_type1.ko drivers/vfio/vfio_virqfd.ko \
         drivers/vfio/pci/vfio-pci-core.ko drivers/vfio/pci/vfio-pci.ko \
         drivers/net/ethernet/intel/e1000/e1000.ko; do
    cp "$kdir/$m" "$dir.tmp/modules/"
done
rm -rf "$dir.tmp/root" "$dir.tmp"/*.deb
rm -rf "$dir" && mv "$dir.tmp" "$dir"
echo "$dir"
