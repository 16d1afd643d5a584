// cpp-httplib (Debian's header-only library) with the settings every tandem server and client
// compiles it with; include this instead of <httplib.h>, so that all translation units agree.
#pragma once

// Pending connections the kernel queues for accept() (httplib's default: 5). A load of 64+
// clients connecting at once overflowed 5: the dropped handshakes were retried after 1 s (the
// TTFT p99 of a 64-stream sweep was 1.07 s) and some connections failed. Linux caps it at
// net.core.somaxconn.
#define CPPHTTPLIB_LISTEN_BACKLOG 1024

#include <httplib.h>  // IWYU pragma: export
