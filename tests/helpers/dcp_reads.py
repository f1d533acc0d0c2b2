"""Counting the bytes DCP reads from a checkpoint's data files (``*.distcp``)."""

import contextlib

from torch.distributed.checkpoint import filesystem


class Counted:
    """A checkpoint file whose reads are counted (every other call goes to the file)."""

    def __init__(self, stream, counter):
        self._stream, self._counter = stream, counter

    def read(self, size=-1):
        data = self._stream.read(size)
        self._counter[0] += len(data)
        return data

    def readinto(self, buffer):
        got = self._stream.readinto(buffer)
        self._counter[0] += got or 0
        return got

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def counting_reads():
    """Yields ``[bytes]``: what every file stream DCP opens on a ``.distcp`` file has read
    so far (through the stream, so a buffered file's read-ahead counts when it is used)."""
    counter = [0]
    create_stream = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def counted(self, path, mode):
        with create_stream(self, path, mode) as stream:
            yield Counted(stream, counter) if str(path).endswith(".distcp") else stream

    filesystem.FileSystem.create_stream = counted
    try:
        yield counter
    finally:
        filesystem.FileSystem.create_stream = create_stream
