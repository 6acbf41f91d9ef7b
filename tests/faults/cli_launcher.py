"""Runs the `wanmesh` command with test hooks set by environment variables (a test helper, not part of the pack).

WANMESH_TEST_POOL_MARKER: a file that gets one line each time a local worker pool starts, so a test can prove
that no worker was started. WANMESH_TEST_FSIZE: a file-size limit (RLIMIT_FSIZE, bytes) set in this process just
before the MP4 is written, after the pool is gone: a full disk for the writer only (SIGXFSZ is ignored, so the
write fails with EFBIG as on a full file system).
"""

import os
import resource
import signal
import sys

from wanmesh.parallel.cli import generate as generate_module
from wanmesh.parallel.cli import main
from wanmesh.parallel.driver import local

marker = os.environ.get("WANMESH_TEST_POOL_MARKER")
if marker:
    starting = local.LocalWorkers.__init__

    def marked_init(self, *args, **kwargs):
        with open(marker, "a") as stream:
            stream.write("pool started\n")
        starting(self, *args, **kwargs)

    local.LocalWorkers.__init__ = marked_init

limit = os.environ.get("WANMESH_TEST_FSIZE")
if limit:
    writing = generate_module.write_mp4

    def limited_write(*args, **kwargs):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        return writing(*args, **kwargs)

    generate_module.write_mp4 = limited_write

sys.exit(main(sys.argv[1:]))
