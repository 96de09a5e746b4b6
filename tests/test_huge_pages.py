"""attnjax.huge_pages: a command restarts itself once under ``glibc.malloc.hugetlb=1`` (same PID,
same arguments), after which glibc's large blocks fault in as 2 MiB pages; switched off or set by
the user, nothing restarts. Real processes, real glibc, the kernel's own page accounting."""

import json
import os
import subprocess
import sys

import pytest

from attnjax import huge_pages

# Restarts where wanted, then faults in 64 MiB from glibc's malloc (not numpy's allocator, which
# asks the kernel for huge pages of its own) and reads the kernel's count of huge pages mapped.
PROCESS = r"""
import ctypes, json, os, sys
from attnjax import huge_pages
started = os.environ.get("STARTED_AS")
os.environ["STARTED_AS"] = str(os.getpid())
huge_pages.restart_with_huge_pages()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
size = 64 << 20
block = libc.malloc(ctypes.c_size_t(size))
ctypes.memset(block, 1, size)
rollup = open("/proc/self/smaps_rollup").read().splitlines()
huge_kib = sum(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages:"))
print(json.dumps(dict(pid=os.getpid(), first_pid=started, argv=sys.argv[1:],
                      tunables=huge_pages.in_effect(), huge_mib=huge_kib / 1024)))
"""


def _run(**env):
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", huge_pages.SWITCH)}
    process = subprocess.Popen(
        [sys.executable, "-c", PROCESS, "an-argument"],
        env={**base, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-2000:]
    return process.pid, json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc are Linux's")
def test_a_command_restarts_once_under_huge_pages_where_the_machine_gives_them():
    pid, got = _run()
    assert got["pid"] == pid and got["argv"] == ["an-argument"]
    if huge_pages.available():
        # Restarted: the second start saw the first's PID in the environment it inherited.
        assert got["first_pid"] == str(pid)
        assert got["tunables"] == huge_pages.tunables_with_huge_pages("")
        assert "glibc.malloc.hugetlb=1" in got["tunables"].split(":")
        assert got["huge_mib"] >= 32, got
    else:
        assert got["first_pid"] is None and got["tunables"] == ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc are Linux's")
def test_switched_off_or_set_by_the_user_nothing_restarts():
    _, off = _run(ATTNJAX_HUGE_PAGES="0")
    assert off["first_pid"] is None and off["tunables"] == ""
    if huge_pages.available():
        # Without the request glibc's blocks stay on 4 KiB pages under the `madvise` mode.
        assert off["huge_mib"] < 32, off
    _, theirs = _run(GLIBC_TUNABLES="glibc.malloc.hugetlb=0")
    assert theirs["first_pid"] is None and theirs["tunables"] == "glibc.malloc.hugetlb=0"


def test_the_tunables_are_added_to_the_users_own_and_never_replace_theirs():
    ours = "glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"
    assert huge_pages.tunables_with_huge_pages("") == ours
    assert (
        huge_pages.tunables_with_huge_pages("glibc.malloc.arena_max=2")
        == "glibc.malloc.arena_max=2:" + ours
    )
    assert huge_pages.tunables_with_huge_pages("glibc.malloc.hugetlb=0") is None
    assert huge_pages.tunables_with_huge_pages("glibc.malloc.hugetlb=2:x=1") is None
    assert huge_pages.tunables_with_huge_pages("x=1:glibc.malloc.trim_threshold=0") is None


def test_the_kernels_mode_is_read_from_its_bracket(tmp_path):
    modes = tmp_path / "enabled"
    for text, mode in [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
    ]:
        modes.write_text(text)
        assert huge_pages.thp_mode(str(modes)) == mode
    assert huge_pages.thp_mode(str(tmp_path / "missing")) is None
