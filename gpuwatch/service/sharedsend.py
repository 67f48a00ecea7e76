"""One copy of a fan-out's bytes for every subscriber that takes the same bytes.

A burst that goes to many subscribers with the same filter is the same run of bytes sent to
each socket. A plain ``send`` copies it into the kernel once per socket: with a hundred
subscribers that copy is most of the daemon's fan-out work, and the kernel holds a hundred
copies until they are read. Written once into an anonymous in-memory file (``memfd``), the
bytes can be handed to each socket by ``sendfile``, which queues references to the file's
pages instead of copies (unix stream sockets take spliced pages; older kernels copy, which is
still correct). The file is written once and never again, and closed after the flush: the
pages a socket still holds stay theirs until read, unchanged.

What the kernel does not take at once (a full socket buffer) the caller queues from its
own bytes, behind what was sent, so nothing is lost or reordered. Where ``memfd_create`` or
``sendfile`` is refused (a seccomp profile, an old kernel), the plain path is all there is.
"""

from __future__ import annotations

import errno
import os

#: Below this many bytes a plain send per socket costs less than a file and its page
#: references (measured on unix stream sockets: per socket, the two meet between 8 and
#: 32 KiB).
MIN_BYTES = 32 << 10
#: Fewer subscribers sharing the bytes do not repay writing the file first (measured: at
#: 32 to 128 KiB, 4 sharers cost 10 to 40% more than plain sends, 8 about the same, 16 a third
#: less, 100 a third of the plain cost).
MIN_SHARERS = 8

# Errors that say the call will never work here, as opposed to a passing shortage (EMFILE).
_UNSUPPORTED = frozenset({errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EINVAL,
                          errno.EOPNOTSUPP})


class SharedBytes:
    """Bytes held in an anonymous in-memory file, to be sent to many sockets by reference.

    `close` it at the end of the flush. ``fd`` is -1 when the file could not be made;
    `send_to` then sends nothing and the caller sends the bytes itself."""

    __slots__ = ("fd", "size")

    #: Cleared for the process once the kernel refuses the file or the call for good.
    supported = True

    def __init__(self, data: bytes | memoryview) -> None:
        self.size = len(data)
        self.fd = -1
        if not SharedBytes.supported:
            return
        try:
            fd = os.memfd_create("gpuwatch-fanout", os.MFD_CLOEXEC)
        except (AttributeError, OSError) as exc:
            self._refused(exc)
            return
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError as exc:  # out of memory for the file: send plainly
            os.close(fd)
            self._refused(exc)
            return
        self.fd = fd

    @staticmethod
    def _refused(exc: BaseException) -> None:
        if not isinstance(exc, OSError) or exc.errno in _UNSUPPORTED:
            SharedBytes.supported = False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def send_to(self, sock_fd: int) -> int:
        """Hand the bytes to the non-blocking socket ``sock_fd``, from the start, as far as
        it takes them now: how many it took. Any error (a full buffer, a peer gone, a call
        refused) ends it early; the caller sends the rest plainly, and that send meets the
        error again if it is the socket's."""
        fd, size = self.fd, self.size
        if fd < 0:
            return 0
        sent = 0
        while sent < size:
            try:
                n = os.sendfile(sock_fd, fd, sent, size - sent)
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno in _UNSUPPORTED and sent == 0:
                    SharedBytes.supported = False
                break
            if n <= 0:
                break
            sent += n
        return sent
