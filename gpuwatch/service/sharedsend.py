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
#: ``MFD_NOEXEC_SEAL`` (Linux 6.3+): a file no one may make executable. Where
#: ``vm.memfd_noexec`` is 2 a memfd without it is refused (EACCES); kernels before 6.3 do not
#: know the flag (EINVAL) and are asked again without it.
_NOEXEC_SEAL = getattr(os, "MFD_NOEXEC_SEAL", 0x0008)
#: `send_to` refusals in a row (no socket took a page in between) that turn sharing off: one
#: socket a security module refuses is no reason to, every socket refused is.
_REFUSALS_TO_STOP = 8


class SharedBytes:
    """Bytes held in an anonymous in-memory file, to be sent to many sockets by reference.

    `close` it at the end of the flush. ``fd`` is -1 when the file could not be made;
    `send_to` then sends nothing and the caller sends the bytes itself."""

    __slots__ = ("fd", "size")

    #: Cleared for the process once the kernel refuses the file or the call for good.
    supported = True
    #: The flags the kernel takes (``MFD_NOEXEC_SEAL`` dropped after an EINVAL).
    flags: int = getattr(os, "MFD_CLOEXEC", 1) | _NOEXEC_SEAL
    #: `send_to` refusals since a socket last took a page.
    refusals = 0

    def __init__(self, data: bytes | memoryview) -> None:
        self.size = len(data)
        self.fd = -1
        if not SharedBytes.supported:
            return
        try:
            fd = self._create()
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
    def _create() -> int:
        try:
            return os.memfd_create("gpuwatch-fanout", SharedBytes.flags)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not SharedBytes.flags & _NOEXEC_SEAL:
                raise
        SharedBytes.flags &= ~_NOEXEC_SEAL  # a kernel before 6.3: the flag is unknown
        return os.memfd_create("gpuwatch-fanout", SharedBytes.flags)

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
                    SharedBytes.refusals += 1
                    if SharedBytes.refusals >= _REFUSALS_TO_STOP:
                        SharedBytes.supported = False
                break
            if n <= 0:
                break
            sent += n
        if sent:
            SharedBytes.refusals = 0
        return sent
