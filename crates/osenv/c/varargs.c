/* The variadic osenv calls: formatted here, handed to Outboard as text. */
#include <stdio.h>
#include <outboard/osenv.h>

/* Defined in Rust (crates/osenv/src/abi.rs). */
void outboard_osenv_log_text(int priority, const char *text);
void outboard_osenv_panic_text(const char *text) __attribute__((noreturn));

void osenv_vlog(int priority, const char *fmt, va_list ap)
{
    char text[1024];
    vsnprintf(text, sizeof text, fmt, ap);
    outboard_osenv_log_text(priority, text);
}

void osenv_log(int priority, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    osenv_vlog(priority, fmt, ap);
    va_end(ap);
}

void osenv_vpanic(const char *fmt, va_list ap)
{
    char text[1024];
    vsnprintf(text, sizeof text, fmt, ap);
    outboard_osenv_panic_text(text);
}

void osenv_panic(const char *fmt, ...)
{
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    outboard_osenv_panic_text(text);
}
