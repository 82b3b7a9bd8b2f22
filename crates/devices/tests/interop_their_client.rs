//! The independent `vfio_user` crate's client (rust-vmm) against our virtio-blk device model.

mod common;

use common::Running;

use std::time::Duration;

use outboard_spec::virtio::common as cfg;

#[test]
fn their_client_reads_our_config_space_regions_and_registers() {
    let srv = Running::start_with(Duration::from_secs(5));
    let path = srv.path.clone();

    let mut c = vfio_user::Client::new(&path).expect("their client connects and negotiates");
    // Region info, including BAR0's sparse mmap area and its fd.
    let bar0 = c.region(0).expect("BAR0");
    assert_eq!(bar0.size, 0x4000);
    assert_eq!(bar0.sparse_areas.len(), 1);
    assert_eq!(
        (bar0.sparse_areas[0].offset, bar0.sparse_areas[0].size),
        (0x2000, 0x1000)
    );
    assert!(
        bar0.file_offset.is_some(),
        "the mmap fd came with the reply"
    );
    assert_eq!(c.region(7).expect("config").size, 256);

    // Configuration space: virtio vendor and modern block device id.
    let mut id = [0u8; 4];
    c.region_read(7, 0, &mut id).unwrap();
    assert_eq!(id, [0xf4, 0x1a, 0x42, 0x10]);
    // A register: num_queues in the common configuration.
    let mut nq = [0u8; 2];
    c.region_read(0, cfg::NUM_QUEUES, &mut nq).unwrap();
    assert_eq!(u16::from_le_bytes(nq), 1);
    // Write a register and read it back: queue_select.
    c.region_write(0, cfg::QUEUE_SELECT, &0u16.to_le_bytes())
        .unwrap();
    let mut qs = [0u8; 2];
    c.region_read(0, cfg::QUEUE_SIZE, &mut qs).unwrap();
    assert_eq!(u16::from_le_bytes(qs), 256);
    let info = c.get_irq_info(2).unwrap();
    assert_eq!(info.count, 2, "MSI-X: config + one queue");

    c.shutdown().unwrap();
    drop(c);
    // Both counters are final once their replies came back: no need to wait for the hang-up.
    let stats = srv.stop();
    assert_eq!(stats.connections, 1);
    assert_eq!(stats.dropped, 0, "their messages were all well formed");
}
