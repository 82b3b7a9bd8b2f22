/* Exercises include/outboard/block.h against a driver server: every call, checked. */
#include <outboard/block.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
    fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)

int main(int argc, char **argv) {
    CHECK(argc == 2, "usage: block_test SERVER_SOCKET");
    ob_block *b = NULL;
    CHECK(ob_block_open_server(argv[1], "nope", &b) == OB_ENODEV, "unknown device must be OB_ENODEV");
    int rc = ob_block_open_server(argv[1], "disk0", &b);
    CHECK(rc == OB_OK, "open: %s", ob_strerror(rc));

    ob_block_info info;
    CHECK(ob_block_get_info(b, &info) == OB_OK, "info");
    CHECK(info.block_size == 512 && info.capacity == 2048 && !info.read_only, "geometry %u %llu",
          info.block_size, (unsigned long long)info.capacity);
    /* The emulated disk takes 1 MiB segments, several per request. */
    CHECK(info.max_transfer >= 1048576 && info.max_transfer % info.block_size == 0,
          "max_transfer %u", info.max_transfer);
    CHECK(sizeof(ob_block_info) == 24, "ob_block_info is %zu bytes", sizeof(ob_block_info));

    /* Synchronous write, flush, read back. */
    unsigned char out[8192], in[8192];
    for (int i = 0; i < 8192; i++) out[i] = (unsigned char)(i * 7 + 3);
    CHECK(ob_block_write(b, 100, out, sizeof out) == OB_OK, "write");
    CHECK(ob_block_flush(b) == OB_OK, "flush");
    memset(in, 0, sizeof in);
    CHECK(ob_block_read(b, 100, in, sizeof in) == OB_OK, "read");
    CHECK(memcmp(in, out, sizeof in) == 0, "read back differs");

    /* Errors are specific. */
    CHECK(ob_block_read(b, 2048, in, 512) == OB_EOUTOFRANGE, "out of range");
    CHECK(ob_block_read(b, 0, in, 100) == OB_EINVAL, "partial block");
    CHECK(strcmp(ob_strerror(OB_EOUTOFRANGE), "blocks beyond the end of the disk") == 0, "strerror");

    /* Asynchronous, zero copy: 16 reads in flight into the buffer area. */
    size_t size = 0;
    unsigned char *buf = ob_block_buffer(b, &size);
    CHECK(buf != NULL && size >= 16 * 512, "buffer area");
    for (int i = 0; i < 16; i++) {
        ob_block_request r = { .op = OB_OP_READ, .blocks = 1, .lba = 100 + i, .buf_offset = i * 512, .tag = 1000 + i };
        CHECK(ob_block_submit(b, &r) == OB_OK, "submit %d", i);
    }
    CHECK(ob_block_kick(b) == OB_OK, "kick");
    int got = 0, seen[16] = {0};
    while (got < 16) {
        ob_block_completion c[4];
        int n = ob_block_wait(b, c, 4, 5000);
        CHECK(n > 0, "wait after %d completions: %d (%s)", got, n, ob_strerror(n));
        for (int k = 0; k < n; k++) {
            CHECK(c[k].status == OB_OK && c[k].bytes == 512, "completion %llu status %d", (unsigned long long)c[k].tag, c[k].status);
            CHECK(c[k].tag >= 1000 && c[k].tag < 1016 && !seen[c[k].tag - 1000], "tag %llu", (unsigned long long)c[k].tag);
            seen[c[k].tag - 1000] = 1;
        }
        got += n;
    }
    CHECK(memcmp(buf, out, 16 * 512) == 0, "async reads differ");

    CHECK(ob_block_discard(b, 100, 1) == OB_OK, "discard");
    CHECK(ob_block_read(b, 100, in, 512) == OB_OK, "read after discard");
    for (int i = 0; i < 512; i++) CHECK(in[i] == 0, "discarded block not zero at %d", i);

    ob_block_close(b);
    printf("block_test: all checks passed\n");
    return 0;
}
