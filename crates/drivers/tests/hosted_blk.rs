//! What the hosted `virtio-drivers` block driver relies on besides the crate: finding the memory
//! behind a device address (`DmaSpace::memory_at`), and refusing what it cannot serve.

use std::sync::Arc;

use outboard_devices::backing::Backing;
use outboard_hw::backend::in_process::InProcess;
use outboard_hw::PciFunction;

fn function() -> PciFunction {
    let model =
        outboard_devices::virtio_blk(Backing::open("mem:1M", None).unwrap(), Default::default())
            .unwrap();
    let backend = Arc::new(InProcess::new(Box::new(model)));
    PciFunction::with_backend("in-process".into(), backend).unwrap()
}

#[test]
fn the_memory_behind_a_device_address_is_found_while_it_is_mapped() {
    let f = function();
    let buf = f.dma().alloc(8192).unwrap();
    buf.write(4096, b"found").unwrap();
    let (mem, offset) = f.dma().memory_at(buf.iova() + 4096, 5).unwrap();
    assert_eq!(offset, 4096);
    let mut got = [0u8; 5];
    mem.read(offset, &mut got).unwrap();
    assert_eq!(&got, b"found");
    // A range running past the buffer, or before any, is not one buffer's.
    assert!(f.dma().memory_at(buf.iova() + 8190, 10).is_none());
    assert!(f.dma().memory_at(buf.iova() - 1, 2).is_none());
    assert!(f.dma().memory_at(u64::MAX - 1, 10).is_none());
    let iova = buf.iova();
    drop(buf);
    assert!(
        f.dma().memory_at(iova, 1).is_none(),
        "found after unmapping"
    );
}

#[test]
fn the_hosted_driver_starts_on_the_model_and_says_what_it_takes() {
    let f = function();
    let d = outboard_drivers::hosted::blk::HostedBlk::start("disk0", f).unwrap();
    let info = outboard_block::BlockDriver::info(&d);
    assert_eq!(info.capacity, 2048);
    assert_eq!(info.block_size, 512);
    assert_eq!(info.max_transfer, 64 * 1024);
    // The model takes indirect descriptors: a request takes one of the crate's 16.
    assert_eq!(info.queue_depth, 16);
}
