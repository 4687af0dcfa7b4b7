"""sandbox.py through tools.python: what a program the model wrote cannot do. It cannot write outside its own tmpfs
(the venv's site-packages, the checkout, the system) nor see the checkout, the venv or the home folder; it cannot read
the trainer's environment or working folder through /proc; every process it started is dead when the call returns,
one that left its session included; output past the limit is not read; memory, processes and disk bound the whole
program; it has no network; and where the sandbox cannot run, the tool says so (RuntimeError) unless told to run
unsandboxed. Each case ran against the unsandboxed tool too, where it fails.

Where this machine cannot run the sandbox (no bwrap, no writable cgroup) the tests that need it skip, and fail
under ICEPOP_REQUIRE_EXTRAS=1 (`make test`, which installs bubblewrap)."""

import os
import socket
import subprocess
import sys
import sysconfig
import time
import uuid

import pytest

from conftest import ENV, REPO, REQUIRE_EXTRAS
import sandbox
from tools import PythonLimits, python


def require_sandbox():
    """Skip the calling test where the sandbox cannot run here; under ICEPOP_REQUIRE_EXTRAS=1 fail it."""
    import sandbox

    try:
        sandbox.check()
    except sandbox.SandboxError as e:
        if REQUIRE_EXTRAS:
            pytest.fail(f"{e} (ICEPOP_REQUIRE_EXTRAS=1: this run is expected to have it)", pytrace=False)
        pytest.skip(str(e))


@pytest.fixture
def sandboxed():
    require_sandbox()


def marked(marker: str) -> list[int]:
    """The pids of the processes whose command line holds `marker` (this test's own excluded)."""
    pids = []
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if p.isdigit() and int(p) != os.getpid() and marker.encode() in f.read():
                    pids.append(int(p))
        except OSError:
            pass
    return pids


def trainer(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """A trainer stand-in: a Python process in the checkout, with `env` added, that runs `code` (with tools imported)."""
    return subprocess.run(
        [sys.executable, "-c", f"import tools\n{code}"],
        cwd=REPO,
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cannot_write_outside_its_tmpfs_nor_see_the_checkout(sandboxed, tmp_path):
    targets = [
        sysconfig.get_paths()["purelib"],  # the trainer's (the venv's) site-packages
        os.path.join(
            sys.base_prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages"
        ),
        REPO,
        str(tmp_path),  # a run folder
        os.path.expanduser("~"),
        "/etc",
        "/usr/lib",
        "/",
        "/dev/shm",
    ]
    code = f"""
import os, subprocess
def plant():
    for d in {targets!r}:
        p = os.path.join(d, "icepop-planted.pth")
        try:
            open(p, "w").close()
        except OSError:
            continue
        os.remove(p)  # the test must not leave it behind where it works
        print("wrote", p)
plant()
subprocess.run(["mount", "-o", "remount,rw,bind", {sys.base_prefix!r}], capture_output=True)  # root: caps dropped
subprocess.run(["mount", "-o", "remount,rw,bind", "/etc"], capture_output=True)
plant()
open("mine.txt", "w").write("ok")
print("own folder:", open("mine.txt").read())
for p in {[REPO, sys.prefix, str(tmp_path)]!r}:
    print(p, "visible" if os.path.exists(p) else "hidden")
print("home:", os.listdir(os.path.expanduser("~")) if os.path.isdir(os.path.expanduser("~")) else None)
"""
    out = python(code, PythonLimits(output_chars=10000))
    assert "wrote" not in out and "own folder: ok" in out, out
    assert "visible" not in out and out.count("hidden") == 3, out
    # the home folder shows at most the one folder on the way to the Python install it runs from
    home = os.path.realpath(os.path.expanduser("~"))
    below = os.path.relpath(os.path.realpath(sys.base_prefix), home).split(os.sep)[0]
    assert f"home: {[below]}" in out or "home: None" in out or "home: []" in out, out


def test_cannot_read_the_trainers_environment_or_folder_through_proc(sandboxed):
    secret = f"icepop-secret-{uuid.uuid4().hex}"
    code = f"""
import os
found = []
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            found.append(open(f"/proc/{{p}}/environ", "rb").read())
            found.append(os.readlink(f"/proc/{{p}}/cwd").encode())
        except OSError:
            pass
seen = b"\\n".join(found)
print("processes:", len(found) // 2, "secret:", {secret!r}.encode() in seen, "checkout:", {REPO!r}.encode() in seen)
"""
    r = trainer(f"print(tools.python({code!r}))", env={"ICEPOP_TEST_SECRET": secret})
    assert r.returncode == 0, r.stderr
    assert "secret: False" in r.stdout and "checkout: False" in r.stdout, r.stdout
    assert "processes: 0" not in r.stdout, r.stdout  # it did read /proc: its own namespace's


def test_every_process_it_started_is_dead_when_the_call_returns(sandboxed):
    marker = f"icepop-linger-{uuid.uuid4().hex}"
    linger = f"""
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", {marker!r}],
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("started")
"""
    assert python(linger) == "started\n"
    assert marked(marker) == []
    # a grandchild that leaves the session and holds the output pipe: the call ends at its limit all the same
    escape = f"""
import os, sys, time
if os.fork() == 0:
    if os.fork() == 0:
        os.setsid()
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(8)", {marker!r}])
    os._exit(0)
time.sleep(8)
"""
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="ran past the 1 s time limit"):
        python(escape, PythonLimits(timeout=1))
    assert time.monotonic() - t0 < 2.5  # the brief's bound: about the limit + 1 s
    assert marked(marker) == []


def test_output_past_the_limit_is_not_read(sandboxed):
    # 384 MiB as fast as it can: the trainer keeps a few KiB and stops the program
    flood = "import os\nb = b'x' * 2 ** 20\nfor _ in range(384):\n    os.write(1, b)"
    r = trainer(
        "import resource\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"out = tools.python({flood!r})\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"  # KiB
        "print(repr(out[-80:]))"
    )
    assert r.returncode == 0, r.stderr
    growth_kib, tail = r.stdout.splitlines()
    assert int(growth_kib) < 100 * 1024, r.stdout
    assert "(output cut at 2000 characters; the program was stopped there)" in tail, r.stdout


def test_memory_processes_and_disk_bound_the_whole_program(sandboxed):
    # three children of 300 MiB each under 512 MiB: not all three hold their memory at once
    memory = """
import os, time
r, w = os.pipe()
release_r, release_w = os.pipe()
for _ in range(3):
    if os.fork() == 0:
        os.close(release_w)
        b = b"x" * (300 << 20)
        os.write(w, b"1")
        os.read(release_r, 1)  # holds its memory until the parent has gone
        os._exit(0)
os.set_blocking(r, False)
got, died, deadline = 0, 0, time.monotonic() + 5
while got < 3 and not died and time.monotonic() < deadline:
    try:
        got += len(os.read(r, 3))
    except BlockingIOError:
        pass
    died = os.waitpid(-1, os.WNOHANG)[0]  # after the read: a third allocation needs a death first
    time.sleep(0.01)
print("all three held" if got == 3 and not died else f"{got} held, a child died: {bool(died)}")
"""
    out = python(memory)
    assert "all three held" not in out, out
    # 256 processes: at most 32 (processes and threads together)
    forks = """
import os
r, w = os.pipe()
n = 0
for _ in range(256):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.close(w)
        os.read(r, 1)  # until the parent has gone
        os._exit(0)
    n += 1
print("forked", n)
"""
    n = int(python(forks).split()[1])
    assert 0 < n < 32
    # 64 files of 1 MiB in a 64 MiB tmpfs that also holds main.py: not all of them
    disk = """
n = 0
try:
    for i in range(64):
        with open(f"f{i}", "wb") as f:
            f.write(b"x" * 2 ** 20)
        n += 1
except OSError as e:
    print(e.strerror)
print("written", n)
"""
    out = python(disk)
    assert "No space left on device" in out and "written 64" not in out, out


def test_no_network(sandboxed):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1)
    print("connected")
except OSError as e:
    print("refused:", e)
"""
        out = python(code)
        assert "connected" not in out and "refused:" in out, out
        with pytest.raises(BlockingIOError):
            server.accept()


def test_the_same_program_gives_the_same_output(sandboxed):
    code = "import os, socket, sys\nprint(os.getpid(), os.getcwd(), sorted(os.listdir('.')), sorted(os.environ))"
    assert python(code) == python(code)


def test_no_sandbox_is_an_error_that_names_the_install_unless_unsandboxed(monkeypatch, tmp_path):
    import sandbox

    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    for call in (sandbox.check, lambda: python("print(1)")):
        with pytest.raises(RuntimeError, match="apt-get install -y bubblewrap"):
            call()
    assert python("print(1)", PythonLimits(unsandboxed=True)) == "1\n"
    monkeypatch.undo()
    mounts = tmp_path / "mounts"  # a machine with no cgroup mounted
    mounts.write_text("proc /proc proc rw 0 0\n")
    monkeypatch.setattr(sandbox, "MOUNTS", str(mounts))
    with pytest.raises(RuntimeError, match="needs a writable cgroup with the memory and pids controller"):
        sandbox.check()


def test_bwrap_failing_to_build_the_sandbox_is_an_error_a_program_cannot_fake(sandboxed):
    import sandbox

    argv, paths = sandbox.interpreter()
    with pytest.raises(RuntimeError, match="bwrap cannot build the sandbox here: bwrap: Can't find source path"):
        sandbox.run([*argv, "-c", "pass"], {}, sandbox.Limits(), keep_bytes=100, read_only=["/icepop-no-such-path"])
    fake = 'import sys\nsys.stderr.write("bwrap: Can\'t find source path\\n")\nsys.exit(1)'
    assert python(fake) == "bwrap: Can't find source path\n\n(exit code 1)"


def test_a_tool_environment_whose_python_tool_has_no_sandbox_stops_the_run(monkeypatch, tmp_path):
    """Inside a run the missing sandbox is not the model's error to see (ToolEpisode answers a tool's Exception as
    its output): SandboxError stops the run, with the install command."""
    import tools

    class Coder:
        def reset(self, **row):
            pass

        def python(self, code: str) -> str:
            """Run a program.

            Args:
                code: the source.
            """
            return tools.python(code)

        def get_reward(self) -> float:
            return 0.0

    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    ep = tools.tool_env(Coder)()
    ep.reset({"prompt": "go"})
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    with pytest.raises(sandbox.SandboxError, match="apt-get install -y bubblewrap"):
        ep.step(call)
