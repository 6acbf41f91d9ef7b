"""Runs the `wanmesh` command with test hooks set by environment variables (a test helper, not part of the pack).

WANMESH_TEST_POOL_MARKER: a file that gets one line each time a local worker pool starts, so a test can prove
that no worker was started. WANMESH_TEST_FSIZE: a file-size limit (RLIMIT_FSIZE, bytes) set in this process just
before the MP4 is written, after the pool is gone: a full disk for the writer only (SIGXFSZ is ignored, so the
write fails with EFBIG as on a full file system). WANMESH_TEST_CHUNK_DIR_EVENTS: what happens to `stream`'s chunk
folder before a chunk is handled, e.g. "1:remove,3:restore" (remove: deleted with its files; file: replaced by a
plain file; restore: a folder again, empty).
"""

import os
import resource
import shutil
import signal
import sys
from pathlib import Path

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

CHUNK_DIR_ACTIONS = {
    "remove": lambda folder: shutil.rmtree(folder),
    "file": lambda folder: (shutil.rmtree(folder), folder.write_text("not a folder")),
    "restore": lambda folder: (folder.unlink() if folder.is_file() else None, folder.mkdir()),
}
events = os.environ.get("WANMESH_TEST_CHUNK_DIR_EVENTS")
if events:
    from wanmesh.parallel.cli import stream as stream_module

    planned = {int(index): action for index, action in (event.split(":") for event in events.split(","))}
    handling = stream_module.ChunkWriter.__call__

    def with_chunk_dir_events(self, chunk):
        if chunk.index in planned:
            CHUNK_DIR_ACTIONS[planned[chunk.index]](Path(self.folder))
        return handling(self, chunk)

    stream_module.ChunkWriter.__call__ = with_chunk_dir_events

sys.exit(main(sys.argv[1:]))
