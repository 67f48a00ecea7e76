"""Fault-tolerant primitive reads (every sysfs read in gpuwatch goes through here), and the
one atomic write of the small files gpuwatch keeps (records, unit files, NFD features)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator

from gpuwatch.core.pci import CONFIG_ATTRS, config_attr, is_pci_addr
from gpuwatch.errors import UNREADABLE, HostError

# O_NONBLOCK: a FIFO planted where an attribute should be opens at once instead of waiting
# for a writer forever; O_NOCTTY: a tty there never becomes our terminal.
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
#: An attribute is at most a page; anything longer than this is not one.
ATTR_CAP = 65536


class NotARegularFile(HostError, OSError):
    """A FIFO, socket, device node or directory where a file was expected."""

    code = UNREADABLE


def open_regular(path: str) -> int:
    """A read-only descriptor of ``path`` if it is a regular file, else `OSError`.

    Sysfs and procfs attributes are regular files to ``stat``. Anything else is refused
    *before* it is opened (opening a device node runs its driver's open, a FIFO waits for a
    writer), and checked again on the descriptor, so a swap in between is caught too.
    """
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise NotARegularFile(errno.EINVAL, "not a regular file", path)
    fd = os.open(path, _READ_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotARegularFile(errno.EINVAL, "not a regular file", path)
    except OSError:
        os.close(fd)
        raise
    return fd


def read_bytes(path: str, cap: int = ATTR_CAP) -> bytes:
    """At most ``cap`` bytes of the regular file ``path``; `OSError` otherwise
    (`NotARegularFile` for a special file, ``EFBIG`` when the file is longer than ``cap``)."""
    fd = open_regular(path)
    try:
        return read_capped(fd, cap, path)
    finally:
        os.close(fd)


def read_capped(fd: int, cap: int, path: str) -> bytes:
    """All of the open file ``fd`` (``path``, for the error), at most ``cap`` bytes;
    ``EFBIG`` when it is longer: for the callers that check the descriptor before reading."""
    chunks: list[bytes] = []
    total = 0
    while True:
        data = os.read(fd, cap + 1 - total)
        if not data:
            break
        chunks.append(data)
        total += len(data)
        if total > cap:
            raise OSError(errno.EFBIG, f"longer than {cap} bytes", path)
    return b"".join(chunks)


def read_text(path: str) -> str | None:
    """A small attribute file's text, stripped; None when it cannot be read for any reason.

    ENOENT/ENODEV (device gone), EACCES, EIO, odd bytes (replaced), trailing NUL padding
    (dropped: GNU tar's, in a captured tree) and a special file planted where the attribute
    should be are all normal on a live host (or a hostile tree) and must not stop, or
    block, a scan.
    """
    # os.open/os.read, not open(): no buffered file object per attribute, which is a third of
    # the cost of a scan. One read suffices: sysfs hands out an attribute in a single read.
    try:
        fd = open_regular(path)
    except (OSError, ValueError):
        return None
    return _read_closing(fd)


def read_kernel_attr(path: str) -> str:
    """`read_attr` of a file in the kernel's own sysfs (`HostPaths.live`), where nothing but
    the kernel makes a file (no FIFO, no device node, links that stay inside): without the
    two checks that guard a tree of unknown origin, whose ``stat`` walks the whole path
    again (two thirds of the cost of a read)."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except (OSError, ValueError):
        return ""
    text = _read_closing(fd)
    return "" if text is None else text


def _read_closing(fd: int) -> str | None:
    """The text `read_text` makes of the attribute open at ``fd``, which it closes."""
    try:
        data = os.read(fd, ATTR_CAP)
    except OSError:
        return None
    finally:
        os.close(fd)
    # rstrip(b"\0"): a tree captured with GNU tar holds every attribute padded with NULs to
    # the 4096 bytes sysfs reports as its size; no sysfs text attribute ends in a NUL.
    return data.rstrip(b"\0").decode("utf-8", "replace").strip()


def small_count(text: str) -> int:
    """A count or id as sysfs writes one (ASCII decimal); 0 for anything else, a number too
    long for any count included (int() refuses over 4300 digits, and would take ``1_0``)."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else 0


def read_attr(path: str) -> str:
    """Like `read_text`, with ``""`` for unreadable."""
    text = read_text(path)
    return "" if text is None else text


#: Config space a `pci_attr` fallback reads: the header and the capabilities that follow it
#: (all a non-root read of sysfs's ``config`` gets is 64 bytes; root's, 256 or 4096).
CONFIG_HEAD = 256


def pci_attr(directory: str, name: str, read: Callable[[str], str] = read_attr) -> str:
    """A PCI function's attribute ``name`` read with ``read``; where that gives no text (the
    file missing, unreadable, empty or all NUL padding) and ``name`` is one the kernel makes
    of config space (`CONFIG_ATTRS`), what the function's ``config`` file says instead
    (`config_attr`): ``rsync -a`` of ``/sys`` keeps ``config`` (its read fills the size
    ``stat`` reports) and drops every text attribute (each reads shorter than its 4096).
    A present attribute is never overridden, garbage included; a normal tree pays nothing."""
    text = read(directory + "/" + name)
    if text or name not in CONFIG_ATTRS:
        return text
    try:
        fd = open_regular(directory + "/config")
    except (OSError, ValueError):
        return ""
    try:
        config = os.read(fd, CONFIG_HEAD)
    except OSError:
        return ""
    finally:
        os.close(fd)
    return config_attr(config, name)


def link_name(path: str, missing: Callable[[], str] | None = None) -> str:
    """The name a sysfs link stands for: the basename of its target (``driver`` → ``nvidia``,
    in any spelling, ``../../../0000:03:00.0`` too, dangling or not); ``""`` when absent,
    or what ``missing()`` says when there is nothing at ``path`` (ENOENT). A byte of the
    target that is not UTF-8 reads as U+FFFD (`name_text`): every reader, the uevent
    re-reads included, names it as a scan does.

    Trees copied by capture tools often hold a real directory where the kernel has a link
    (the copy of what it pointed to): then the directory names itself, see `dir_link_name`.
    """
    try:
        target = os.readlink(path)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return dir_link_name(path)
        return missing() if missing is not None and exc.errno == errno.ENOENT else ""
    except ValueError:
        return ""
    return name_text(target.rstrip("/").rpartition("/")[2])  # os.path.basename, less its cost


def write_atomic(path: str, content: str | bytes, mode: int = 0o644, *,
                 owner: os.stat_result | None = None, sync_dir: bool = False) -> None:
    """A new file renamed over ``path``: a reader never sees half of it, and a crash leaves
    the old file or the new (fsynced first), never an empty one. The temporary file is
    hidden (``.NAME.XXXXXXXX.gpuwatch-new``: readers of a whole directory, like NFD's
    ``features.d``, skip it), of a name no one else writes, and made with O_EXCL|O_NOFOLLOW,
    so a FIFO or link planted at a name is never opened. ``owner``: take that file's owner
    and group (a chown we may not do, as a user in a fixture, is skipped). ``sync_dir``:
    fsync the directory too, so the rename itself lasts.
    """
    folder, name = os.path.split(path)
    # mkstemp: O_EXCL|O_NOFOLLOW, mode 0600, and a name of its own per writer, so two
    # processes writing one record at once never take each other's half-written file.
    # (Imported here: it brings shutil and random, and a report that only reads the tree,
    # `status` on a daemon's answers, needs neither.)
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".gpuwatch-new", dir=folder or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content.encode("utf-8") if isinstance(content, str) else content)
            f.flush()
            if owner is not None:
                with contextlib.suppress(PermissionError):
                    os.fchown(f.fileno(), owner.st_uid, owner.st_gid)
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_dir:
        dfd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def make_dirs(folder: str) -> None:
    """``os.makedirs`` of a folder gpuwatch keeps records or locks in, each folder it makes
    0755 at most whatever the umask (``os.makedirs`` gives the ones above 0777 less the
    umask: all of them world-writable under a umask of 0). `OSError` to the caller."""
    missing: list[str] = []
    here = os.path.abspath(folder)
    while not os.path.isdir(here):
        missing.append(here)
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another writer
            os.mkdir(path, 0o755)
    if not os.path.isdir(folder):
        raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), folder)


#: Where a path whose links loop leads: under a file that is no folder (``/dev/null``), so
#: every read there fails (ENOTDIR) and so does every write, a ``makedirs`` included: no
#: tree can hold it, nor be made to by a write that lands there.
NOWHERE = os.path.join(os.devnull, ".gpuwatch-links-loop")


def in_root(root: str, path: str) -> str:
    """``path`` itself, or, when it is a link spelled absolute (``/sys/devices/…``), the place
    under ``root`` it names: a copied tree may hold the kernel's relative links so, and as
    in a chroot they lead inside the tree, never into the host running us."""
    try:
        target = os.readlink(path)
    except (OSError, ValueError):
        return path
    return rooted_target(root, path, target)


def rooted_target(root: str, path: str, target: str) -> str:
    """`in_root` of the link ``path`` whose target, already read, is ``target``. A relative
    target spelled to climb past ``root`` (only a damaged or hostile tree's) is resolved as
    in a chroot (`resolve_in_root`): followed by the kernel it would lead into the host."""
    if target.startswith("/"):
        return os.path.join(root, os.path.normpath(target).lstrip("/"))
    # Compared absolute (`abspath` only normalises an absolute path; a root given relative,
    # ``./host`` or ``../x/host``, asks for the working directory once).
    top = os.path.abspath(root)
    lexical = os.path.abspath(os.path.join(os.path.dirname(path), target))
    if lexical.startswith(top.rstrip("/") + "/") or lexical == top:
        return path
    try:
        return resolve_in_root(top, os.path.abspath(path), follow_last=True)
    except (OSError, ValueError):  # a chain of links past any bound: nothing to read there
        return NOWHERE


def link_in_root(root: str, path: str) -> tuple[str, str]:
    """(`link_name`, `in_root`) of ``path`` from one ``readlink``: the name a link stands
    for and where its files are read, as a DRM node's ``device`` link is used."""
    try:
        target = os.readlink(path)
    except (OSError, ValueError):
        return link_name(path), path  # a folder copied in its place, or nothing there
    return name_text(target.rstrip("/").rpartition("/")[2]), rooted_target(root, path, target)


def resolve_in_root(root: str, path: str, *, max_links: int = 40,
                    follow_last: bool = False) -> str:
    """The place ``path`` (a path under ``root``) names when every link on the way is read as
    in a chroot at ``root``: an absolute target starts again at ``root``, ``..`` stops there.
    The last component is left as it is (a write opens it with ``O_NOFOLLOW``), unless
    ``follow_last`` (a read: then no link is left in the result to lead out of the tree).

    What makes a write under ``--root`` stay in the tree: a captured tree may spell the
    kernel's links absolute (``/sys/devices/…``), and followed by the kernel such a link
    would lead a switch's ``driver_override`` write to the host running us. With ``root``
    ``/`` this is the kernel's own resolution. Raises `OSError` (``ELOOP``) past
    ``max_links`` links and `ValueError` for a ``path`` outside ``root``.
    """
    root = os.path.abspath(root)
    prefix = root.rstrip("/") + "/"
    if path != root and not path.startswith(prefix):
        raise ValueError(f"{path!r} is not under {root!r}")
    # Not normalised first: ``link/..`` is the parent of the link's target, not of the link.
    rest = path[len(prefix):] if path != root else ""
    pending = [part for part in reversed(rest.split("/")) if part not in ("", ".")]
    resolved: list[str] = []
    links = 0
    while pending:
        part = pending.pop()
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        if not pending and not follow_last:
            resolved.append(part)
            break
        try:
            target = os.readlink(os.path.join(root, *resolved, part))
        except OSError:  # not a link, or absent: the name stands for itself
            resolved.append(part)
            continue
        links += 1
        if links > max_links:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
        if target.startswith("/"):
            resolved = []
        pending.extend(p for p in reversed(target.split("/")) if p not in ("", "."))
    return os.path.join(root, *resolved)


def in_tree(root: str, rel: str) -> str:
    """``root/rel`` with every link on the way read as in a chroot at ``root``
    (`resolve_in_root`), for a read of the tree's own file: on every current distribution
    ``var/run`` is a link to ``/run`` (and ``lib`` may be one to ``/usr/lib``), which, with
    the host's root mounted at ``/host`` and ``--root /host``, would otherwise lead to the
    ``/run`` of the container running gpuwatch. ``""`` when the links loop (under ``/``,
    where the kernel resolves as the chroot would, the path itself: no read gets through)."""
    top = os.path.abspath(root)  # a root given relative (``./host``) is that folder
    if top == "/":  # a chroot at ``/`` is the kernel's own resolution: let the open do it
        return "/" + rel.lstrip("/")
    try:
        return resolve_in_root(top, os.path.join(top, rel.lstrip("/")), follow_last=True)
    except (OSError, ValueError):
        return ""


def tree_dir(root: str, rel: str) -> str:
    """`in_tree` for a place every read goes through (``sys``, ``proc``, ``dev``, a node to
    stat), with a path where nothing is (`NOWHERE`) instead of ``""`` when the links loop.
    The root's own link is read as in a chroot too: a fixture whose ``sys`` is a link to
    ``/sys`` leads back to itself (nowhere), never to the sysfs of the host running us."""
    return in_tree(root, rel) or NOWHERE


class TreePlaces:
    """`tree_dir` of many nodes of one tree (``/dev/vfio/N`` of each GPU a report names),
    each folder on the way resolved once: a node that is no link in its folder's place is
    there, as `resolve_in_root` would find it, and any other (a link, an odd spelling) is
    resolved whole. A host of a hundred GPUs otherwise read every link of ``dev/vfio`` a
    hundred times."""

    __slots__ = ("_folders", "root")

    def __init__(self, root: str) -> None:
        self.root = root
        self._folders: dict[str, str] = {}

    def __call__(self, node: str) -> str:
        head, _, name = node.rpartition("/")
        if name in ("", ".", "..") or not head.strip("/"):
            return tree_dir(self.root, node)
        folder = self._folders.get(head)
        if folder is None:
            folder = self._folders[head] = in_tree(self.root, head)
        if not folder:  # the links loop on the way: nowhere, as a whole resolution says
            return tree_dir(self.root, node)
        place = os.path.join(folder, name)
        try:
            os.readlink(place)
        except OSError:  # no link (or nothing there): the name stands for itself
            return place
        except ValueError:
            pass
        return tree_dir(self.root, node)


def place_in_root(root: str, rel: str, *, follow_last: bool = False) -> str:
    """``root/rel`` for a write: every link on the way read as in a chroot at ``root``, the
    last name left as it is (the write opens it without following, or renames over it),
    or read so too with ``follow_last``, for a path handed to a program that runs outside
    the root and follows whatever link it finds there.
    A path whose links loop leads nowhere (`NOWHERE`): the write fails there (ENOTDIR)."""
    top = os.path.abspath(root)
    try:
        return resolve_in_root(top, os.path.join(top, rel.lstrip("/")), follow_last=follow_last)
    except (OSError, ValueError):
        return os.path.join(NOWHERE, rel.lstrip("/"))


def uevent_value(directory: str, key: str) -> str:
    """``KEY=value`` from a sysfs directory's ``uevent`` file; ``""`` when absent."""
    return _uevent_key(read_text(directory + "/uevent") or "", key)


def _uevent_key(text: str, key: str) -> str:
    prefix = key + "="
    for line in text.splitlines():
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    return ""


def dir_link_name(path: str) -> str:
    """What a directory copied in place of a sysfs link stands for, from the kernel's own
    files: a device (``device``, ``physfn``, ``virtfnN``) by its ``PCI_SLOT_NAME``, a driver
    by the ``DRIVER`` of the device holding the link, an IOMMU group by the group folder
    that lists the device, a subsystem by what only it holds. ``""`` when it cannot tell."""
    parent, _, base = path.rstrip("/").rpartition("/")
    if not os.path.isdir(path):
        return ""
    if base in ("device", "physfn") or base.startswith("virtfn"):
        return uevent_value(path, "PCI_SLOT_NAME")
    if base == "driver":
        return _told_driver(parent)
    if base == "iommu_group":
        return _group_listing(parent)
    if base == "subsystem":
        return "pci" if os.path.exists(path + "/drivers_probe") else ""
    return ""


def name_text(name: str) -> str:
    """A name read from a link's target or a folder's entry, with each byte that is not
    UTF-8 (a lone surrogate, as ``os`` hands such a byte over) as U+FFFD, as `read_text`
    reads an attribute: a name is shown and written out as JSON, which cannot carry one."""
    if name.isascii():
        return name
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def driver_name(device_dir: str) -> str:
    """The driver the PCI function at ``device_dir`` is bound to: the name its ``driver`` link
    stands for (`link_name`), ``""`` when unbound.

    A capture tool may drop the link itself (it leads into ``sys/bus/pci/drivers``, whose
    folders link back to the devices: a cycle to a copier). The kernel's own files still
    say it: the ``DRIVER`` line of the function's ``uevent``, which the kernel writes from
    the same binding (on a live host the two agree, so an unbound function pays one read of
    its ``uevent``), or, where no ``uevent`` was copied either, the driver folder in
    ``sys/bus/pci/drivers`` that lists the function."""
    return link_name(device_dir + "/driver", lambda: _told_driver(device_dir))


def group_name(device_dir: str) -> str:
    """The IOMMU group the PCI function at ``device_dir`` is in, as its ``iommu_group`` link
    names it (`link_name`); where a capture tool dropped the link, the
    ``sys/kernel/iommu_groups/<N>/devices/<addr>`` entry that lists the function (the
    kernel makes and removes the two together). ``""`` when in none."""
    return link_name(device_dir + "/iommu_group", lambda: _group_listing(device_dir))


def _told_driver(device_dir: str) -> str:
    """The driver the kernel's files name for a function whose ``driver`` link is not one:
    its ``uevent``'s ``DRIVER`` (none there: unbound), else the driver folder listing it.
    An empty ``uevent`` (a copy that kept the file and not its text: the kernel's always
    names the function) says nothing, unbound included."""
    text = read_text(device_dir + "/uevent")
    if text:
        return _uevent_key(text, "DRIVER")
    sysdir = _sys_of(device_dir)
    addr = device_dir.rpartition("/")[2]
    if not sysdir or not is_pci_addr(addr) or not os.path.isdir(device_dir):
        return ""
    drivers = sysdir + "/bus/pci/drivers"
    for name in sorted(list_dir(drivers)):
        if os.path.lexists(f"{drivers}/{name}/{addr}"):
            return name
    return ""


def _sys_of(device_dir: str) -> str:
    """The ``…/sys`` folder a device folder lies in (``""`` when none)."""
    marker = device_dir.rfind("/sys/")
    return device_dir[: marker + 4] if marker >= 0 else ""


def _group_listing(device_dir: str) -> str:
    """The IOMMU group whose ``devices/`` lists this device (``sys/kernel/iommu_groups``)."""
    sysdir = _sys_of(device_dir)
    if not sysdir:
        return ""
    groups_dir = sysdir + "/kernel/iommu_groups"
    groups = list_dir(groups_dir)
    if not groups:  # IOMMU off: no need to name the device
        return ""
    name = device_dir.rpartition("/")[2]
    addr = name if is_pci_addr(name) else uevent_value(device_dir, "PCI_SLOT_NAME")
    if not addr:
        return ""
    for group in sorted(groups):
        if os.path.lexists(f"{groups_dir}/{group}/devices/{addr}"):
            return group
    return ""


def present(path: str, *, follow_symlinks: bool = True) -> bool:
    """Whether anything is at ``path`` (with ``follow_symlinks`` False, a link itself, dangling
    or not). Asked before reading what most functions lack (``physfn``, ``sriov_totalvfs``,
    ``vfio-dev``): a failed read costs its syscall and an exception, about twice the cost of
    asking, and an initial scan made three of them per function."""
    try:
        return os.access(path, os.F_OK, follow_symlinks=follow_symlinks)
    except ValueError:  # a NUL in the path: nothing can be there
        return False


def list_dir(path: str) -> list[str]:
    """Directory entries; ``[]`` for a missing or unreadable directory."""
    try:
        return os.listdir(path)
    except (OSError, ValueError):
        return []


def flock_holders(st: os.stat_result, *, exclusive: bool = False) -> Iterator[str]:
    """The pids ``/proc/locks`` names as holding a flock on the file ``st`` describes
    (``exclusive``: a ``WRITE`` one only), waiters left out. Raises `OSError` where
    ``/proc/locks`` cannot be read."""
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks", encoding="ascii", errors="replace") as locks:
        for entry in locks:
            fields = entry.split()
            # "1: FLOCK  ADVISORY  WRITE 26929 fe:00:2158827 0 EOF" (a waiter: "->")
            if (len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key
                    and fields[4].isdigit() and (not exclusive or fields[3] == "WRITE")):
                yield fields[4]


def flock_holder(fd: int, *, pid_file: bool = True) -> str:
    """Who holds a flock on ``fd``'s file, for a refusal: ``pid N`` from the pid a lock file
    holds, else (a directory, a log file itself: ``pid_file`` False) from the first holder
    ``/proc/locks`` names; ``a process in another PID namespace`` where it names pid 0 (the
    host's daemon seen from a pod, or the other way round); ``another process`` when
    neither says."""
    holder = ""
    with contextlib.suppress(OSError, ValueError):
        st = os.fstat(fd)
        if pid_file and stat.S_ISREG(st.st_mode):
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            holder = text if text.isdigit() else ""
        else:
            holder = next(flock_holders(st), "")
    if not holder:
        return "another process"
    return "a process in another PID namespace" if int(holder) == 0 else f"pid {holder}"
