"""Run an untrusted program under Linux namespaces (bubblewrap) and whole-program limits (a cgroup per call).

    import sandbox
    sandbox.check()                                        # at start-up: a RuntimeError naming what is missing
    argv, paths = sandbox.interpreter()                    # the base Python, in isolated mode, and its install folder
    r = sandbox.run([*argv, "main.py"], {"main.py": "print(2 ** 10)"}, sandbox.Limits(), keep_bytes=8016, read_only=paths)
    r.stdout, r.returncode                                 # b'1024\\n', 0

What the program sees (bwrap): /usr, /etc and the Python install it runs from, read-only (with /etc's secrets
hidden); /proc of its own PID namespace; a minimal /dev; a private tmpfs of `disk_bytes` at /tmp, its working folder
and the one place it can write. Nothing else: not the home folder, not the checkout, not the run folder, not the
host's /tmp or /run. No network (a namespace with only its own loopback), no IPC with the host, no capabilities, an
empty environment. Its limits hold for the whole program: memory and process count in a cgroup of its own (v1 or v2),
the rest as per-process rlimits (CPU time, address space, open files, file size), and the wall clock. When the call
returns, every process it started is dead: bwrap's init is PID 1 of the namespace and dies with the call
(--die-with-parent), which takes the namespace down, and the cgroup is emptied and removed.

Output is read as it comes, at most `keep_bytes` per stream: once a stream passes that the program is stopped, and
the rest is never read.

`run(..., sandboxed=False)` is the old, unsafe way (a subprocess with the rlimits and a timeout that kills its
process group), for machines without bwrap or a writable cgroup when the user says so: see tools.PythonLimits.
"""

from __future__ import annotations

import errno
import itertools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

INSTALL = "apt-get install -y bubblewrap"  # Debian / Ubuntu; `make venv` runs it where bwrap is missing
MOUNTS = "/proc/self/mounts"  # where the cgroup hierarchies are found (a module constant, for the tests)
CGROUPS = "/proc/self/cgroup"
WORK = "/tmp"  # the program's working folder inside the sandbox: its tmpfs
HIDDEN = ("/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/etc/sudoers.d", "/etc/ssh", "/etc/ssl/private")
CHUNK = 65536  # bytes per read
POLL = 0.05  # seconds between checks that the program is still running
KILL_WAIT = 5.0  # seconds to wait for a killed cgroup to empty (the kernel tears a PID namespace down quickly)
_calls = itertools.count()


class SandboxError(RuntimeError):
    """The sandbox cannot run here (no bwrap, no namespaces, no writable cgroup): the run should stop."""


@dataclass(frozen=True)
class Limits:
    """One call's limits. Memory and processes bound the whole program (a cgroup); the rlimits bound each process."""

    timeout: float = 5.0  # wall-clock seconds, then every process of the program is killed
    cpu_seconds: int = 5  # RLIMIT_CPU: SIGXCPU at this many CPU seconds, SIGKILL one later
    memory_bytes: int = 512 * 2**20  # the cgroup's memory (swap included), its tmpfs too; also each process's RLIMIT_AS
    processes: int = 32  # the cgroup's pids.max: processes and threads together, bwrap's two included
    disk_bytes: int = 64 * 2**20  # the size of the tmpfs at /tmp, the only place it can write
    open_files: int = 32  # RLIMIT_NOFILE
    file_bytes: int = 2**20  # RLIMIT_FSIZE: the largest file it may write


@dataclass
class Result:
    stdout: bytes  # at most keep_bytes of each stream
    stderr: bytes
    returncode: int  # as Popen's: negative for a signal
    timed_out: bool  # ran past limits.timeout and was killed
    cut: bool  # a stream passed keep_bytes: the program was killed there, the rest never read


# ----------------------------------------------------------------------------- checks


def check() -> None:
    """Start-up check: bwrap is installed and can build its namespaces, and a cgroup with memory and pids limits can
    be made. A SandboxError (a RuntimeError) naming everything that is missing and how to get it. Cheap: one run of
    the base interpreter doing nothing, about the cost of one tool call."""
    problems = []
    for need in (_bwrap, lambda: Cgroup(Limits()).close()):
        try:
            need()
        except SandboxError as e:
            problems.append(str(e))
    if problems:
        raise SandboxError("; and ".join(problems))
    argv, paths = interpreter()
    r = run([*argv, "-c", "pass"], {}, Limits(), keep_bytes=4096, read_only=paths)
    if r.returncode != 0 or r.timed_out:
        raise SandboxError(f"the sandbox runs no Python program here: exit {r.returncode}, {r.stderr[-500:]!r}")


def _bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxError(
            f"the python tool's sandbox needs bubblewrap (bwrap), not found on PATH: {INSTALL} (or `make venv`); "
            "or run the tool unsandboxed with tools.PythonLimits(unsandboxed=True), which is not a security boundary"
        )
    return path


def interpreter() -> tuple[list[str], list[str]]:
    """(argv, read-only paths): the base interpreter of this Python (not a venv's: a venv lives in the checkout) in
    isolated mode (-I: no user site, no PYTHON* variables, not the working folder on the path), and the folders of
    its install to make visible, read-only, at their own paths."""
    exe = getattr(sys, "_base_executable", None) or sys.executable
    paths = list(dict.fromkeys(os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)))
    real = os.path.realpath(exe)
    if not any(real.startswith(p.rstrip("/") + "/") for p in [*paths, "/usr"]):
        paths.append(real)
    return [real, "-I"], paths


# ----------------------------------------------------------------------------- cgroups


def _hierarchies() -> dict[str, tuple[str, int]]:
    """{controller: (this process's cgroup folder for it, 1 or 2)} for memory and pids, from /proc/self/mounts and
    /proc/self/cgroup. A controller in a v1 hierarchy is found there (hybrid set-ups keep memory and pids in v1)."""
    own = {}
    with open(CGROUPS) as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(",") if names else ["unified"]:
                own[name] = path
    found = {}
    with open(MOUNTS) as f:
        for line in f:
            _, mnt, fstype, opts = line.split()[:4]
            mnt = mnt.replace("\\040", " ")
            for c in ("memory", "pids"):
                if fstype == "cgroup" and c in opts.split(",") and c in own:
                    found[c] = (mnt + own[c].rstrip("/"), 1)
                elif fstype == "cgroup2" and "unified" in own and c not in found:
                    folder = mnt + own["unified"].rstrip("/")
                    try:
                        with open(os.path.join(folder, "cgroup.controllers")) as g:
                            if c in g.read().split():
                                found[c] = (folder, 2)
                    except OSError:
                        pass
    return found


class Cgroup:
    """A cgroup of its own for one call: memory (swap included) and pids limits, the process joined before exec,
    everything in it killed and the cgroup removed at the end. One folder per hierarchy (v1: memory and pids apart)."""

    def __init__(self, limits: Limits):
        found = _hierarchies()
        missing = [c for c in ("memory", "pids") if c not in found]
        if missing:
            raise SandboxError(
                f"the python tool's sandbox needs a writable cgroup with the {' and '.join(missing)} controller; none "
                f"is mounted here ({MOUNTS}). Mount cgroups (v1 or v2), run as root or in a delegated cgroup, or run "
                "the tool unsandboxed with tools.PythonLimits(unsandboxed=True)"
            )
        name = f"icepop-tool-{os.getpid()}-{next(_calls)}"
        self.folders = {}  # folder -> version
        self.procs = []  # open cgroup.procs files, written with the child's pid before it execs
        try:
            for c, (parent, version) in found.items():
                folder = os.path.join(parent, name)
                if folder not in self.folders:
                    if version == 2:
                        _enable(parent)
                    os.mkdir(folder)
                    self.folders[folder] = version
                    self.procs.append(os.open(os.path.join(folder, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC))
                self._limit(folder, version, c, limits)
        except OSError as e:
            self.close()
            raise SandboxError(
                f"the python tool's sandbox cannot make its cgroup ({e}); run as root or in a delegated cgroup, or "
                "run the tool unsandboxed with tools.PythonLimits(unsandboxed=True)"
            ) from None

    @staticmethod
    def _limit(folder: str, version: int, controller: str, limits: Limits):
        if controller == "pids":
            writes = [("pids.max", limits.processes)]
        elif version == 1:  # memsw (memory + swap) must not be below the memory limit: memory first
            writes = [
                ("memory.limit_in_bytes", limits.memory_bytes),
                ("memory.memsw.limit_in_bytes", limits.memory_bytes),
            ]
        else:
            writes = [("memory.max", limits.memory_bytes), ("memory.swap.max", 0)]
        for file, value in writes:
            path = os.path.join(folder, file)
            if os.path.exists(path) or file in ("pids.max", "memory.limit_in_bytes", "memory.max"):
                with open(path, "w") as f:
                    f.write(str(value))

    def join(self):
        """In the child, before exec (Popen's preexec_fn): only what is async-signal safe enough, os.write."""
        for fd in self.procs:
            os.write(fd, str(os.getpid()).encode())

    def kill(self, wait: bool = True):
        """SIGKILL to every process in the cgroup (v2: cgroup.kill where the kernel has it); wait: until it is empty."""
        deadline = time.monotonic() + (KILL_WAIT if wait else 0)
        for folder, version in self.folders.items():
            if version == 2 and os.path.exists(os.path.join(folder, "cgroup.kill")):
                with open(os.path.join(folder, "cgroup.kill"), "w") as f:
                    f.write("1")
            while True:
                with open(os.path.join(folder, "cgroup.procs")) as f:
                    pids = [int(p) for p in f.read().split()]
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if not pids or time.monotonic() >= deadline:
                    break
                time.sleep(0.001)

    def close(self):
        for fd in self.procs:
            os.close(fd)
        self.procs = []
        for folder in self.folders:
            for _ in range(200):  # an exiting task can keep the cgroup busy for a moment
                try:
                    os.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                    time.sleep(0.005)


def _enable(parent: str):
    """cgroup v2: let `parent`'s children have the memory and pids controllers (a no-op where they already do)."""
    with open(os.path.join(parent, "cgroup.subtree_control")) as f:
        enabled = f.read().split()
    want = [c for c in ("memory", "pids") if c not in enabled]
    if want:
        try:
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                f.write(" ".join(f"+{c}" for c in want))
        except OSError as e:
            raise OSError(
                e.errno,
                f"cgroup v2 {parent} cannot give its children {', '.join(want)} ({e.strerror}): a cgroup that holds "
                "processes cannot; run the trainer in a leaf of a delegated cgroup",
            ) from None


# ----------------------------------------------------------------------------- running


def bwrap_args(read_only: list[str], limits: Limits) -> list[str]:
    """bwrap's options: namespaces, what is visible (read-only system and interpreter, /proc, /dev, a sized tmpfs)."""
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
    if os.geteuid() == 0:  # as root bwrap keeps every capability unless told: with CAP_SYS_ADMIN a remount undoes ro
        args += ["--cap-drop", "ALL"]
    args += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += ["--ro-bind", "/etc", "/etc"]
    for path in HIDDEN:
        if os.path.isdir(path):
            args += ["--tmpfs", path, "--remount-ro", path]
        elif os.path.exists(path):
            args += ["--ro-bind", "/dev/null", path]
    for path in read_only:
        args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    args += ["--size", str(limits.disk_bytes), "--tmpfs", WORK, "--chdir", WORK, "--remount-ro", "/"]
    return args


def run(
    argv: list[str],
    files: dict[str, str],
    limits: Limits,
    *,
    keep_bytes: int,
    read_only: list[str] = (),
    sandboxed: bool = True,
) -> Result:
    """Run argv with `files` ({name: text}) in its working folder, under `limits`; at most keep_bytes of stdout and
    of stderr are kept. sandboxed=False: a plain subprocess in a host temporary folder with the rlimits only (no
    namespaces, no cgroup; its process group is killed at the end, a child that left it with setsid survives)."""
    if not sandboxed:
        with tempfile.TemporaryDirectory(prefix="tool-python-") as work:
            for name, text in files.items():
                with open(os.path.join(work, name), "w") as f:
                    f.write(text)
            return _run(argv, work, limits, keep_bytes, None, [])
    bwrap = _bwrap()
    cgroup = Cgroup(limits)
    copies = []  # the files, each in an unnamed temporary file that bwrap copies into its tmpfs: no host folder shared
    status_r, status_w = os.pipe()  # bwrap's JSON status: its exit code once the program ran
    try:
        args = [bwrap, *bwrap_args(list(read_only), limits)]
        for name, text in files.items():
            f = tempfile.TemporaryFile()
            copies.append(f)
            f.write(text.encode())
            f.seek(0)
            args += ["--file", str(f.fileno()), f"{WORK}/{name}"]
        args += ["--json-status-fd", str(status_w), "--", *argv]
        r = _run(args, None, limits, keep_bytes, cgroup, [f.fileno() for f in copies] + [status_w])
        os.close(status_w)  # bwrap has exited: the pipe holds all it wrote
        status_w = None
        status = os.read(status_r, CHUNK)
    finally:
        cgroup.kill()
        cgroup.close()
        for f in copies:
            f.close()
        for fd in (status_r, status_w):
            if fd is not None:
                os.close(fd)
    if b'"exit-code"' not in status and not r.timed_out and not r.cut and r.stderr.startswith(b"bwrap: "):
        raise SandboxError(  # bwrap only reports an exit code once the program started: this is its own failure
            f"bwrap cannot build the sandbox here: {r.stderr.decode(errors='replace').strip()} (not root: bwrap "
            "needs unprivileged user namespaces, e.g. sysctl kernel.unprivileged_userns_clone=1 on Debian); or run "
            "the tool unsandboxed with tools.PythonLimits(unsandboxed=True)"
        )
    if 128 < r.returncode < 128 + signal.NSIG:  # bwrap reports death by signal n as 128 + n, like a shell
        r.returncode = 128 - r.returncode
    return r


def _run(args, cwd, limits: Limits, keep_bytes: int, cgroup: Cgroup | None, pass_fds: list[int]) -> Result:
    def child():  # in the child, before exec
        import resource

        for what, n, hard in (
            (resource.RLIMIT_CPU, limits.cpu_seconds, limits.cpu_seconds + 1),  # SIGXCPU first, then SIGKILL
            (resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes),
            (resource.RLIMIT_NOFILE, limits.open_files, limits.open_files),
            (resource.RLIMIT_FSIZE, limits.file_bytes, limits.file_bytes),
        ):
            resource.setrlimit(what, (n, hard))
        if cgroup is not None:
            cgroup.join()

    deadline = time.monotonic() + limits.timeout
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env={},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=child,
        start_new_session=True,
        pass_fds=pass_fds,
    )
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    cut = timed_out = False
    # Until the program exits, not until its pipes close (a child it left behind can hold them open): a pidfd is
    # readable once the process has exited (Linux 5.3; elsewhere a poll every POLL seconds).
    pidfd = os.pidfd_open(proc.pid) if hasattr(os, "pidfd_open") else None
    with selectors.DefaultSelector() as sel:
        for fd in kept:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ)
        while not cut and not _exited(proc):
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(left if pidfd is not None else min(left, POLL)):
                if key.fd == pidfd:
                    continue
                if _read(key.fd, kept[key.fd], keep_bytes) is None:
                    sel.unregister(key.fd)
                cut = cut or len(kept[key.fd]) > keep_bytes
    if pidfd is not None:
        os.close(pidfd)
    _stop(proc, cgroup)
    for fd, buf in kept.items():  # what it wrote before it was stopped: a pipe holds no more than its size
        while len(buf) <= keep_bytes and _read(fd, buf, keep_bytes):
            pass
    proc.stdout.close()
    proc.stderr.close()
    proc.wait()
    cut = cut or any(len(b) > keep_bytes for b in kept.values())
    out, err = (bytes(b[:keep_bytes]) for b in kept.values())
    return Result(out, err, proc.returncode, timed_out, cut)


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the process has exited, without reaping it: its pid (and process group) stay ours until proc.wait."""
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _read(fd: int, buf: bytearray, keep_bytes: int) -> int | None:
    """Read one chunk into buf (keeping one byte past keep_bytes, to tell a cut); None at EOF, 0 when nothing waits."""
    try:
        data = os.read(fd, CHUNK)
    except BlockingIOError:
        return 0
    if not data:
        return None
    buf += data[: keep_bytes + 1 - len(buf)]
    return len(data)


def _stop(proc: subprocess.Popen, cgroup: Cgroup | None):
    """Kill everything the program started: the cgroup (bwrap and the namespace's init with it; run waits for it to
    empty once bwrap is reaped) or the process group."""
    if cgroup is not None:
        cgroup.kill(wait=False)
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
