"""A seccomp filter for sandboxed programs, built here as classic BPF (no libseccomp needed) for bubblewrap's
`--seccomp FD`.

THREAT MODEL. Covered: the system calls below fail with EPERM inside the sandbox, for every process and
thread of the run (the filter is inherited and cannot be removed; bwrap sets no_new_privs). No task needs
them, and each one either reaches state outside the sandbox or is a large kernel attack surface:
- keyrings (`add_key`, `keyctl`, `request_key`): the worker's session keyring (systemd services, ssh/PAM
  logins) would be readable inside and keys added there would be seen by later runs;
- `ptrace`, `process_vm_readv/writev`, `pidfd_getfd`, `process_madvise`, `kcmp`: reading or changing another
  process of the same uid (the code verifier's harness, a concurrent test process);
- mount family (`mount`, `umount2`, `pivot_root`, `move_mount`, `open_tree`, `fsopen`, `fsconfig`,
  `fsmount`, `fspick`, `mount_setattr`, `chroot`) and namespaces (`unshare`, `setns`): changing the
  filesystem view or building nested namespaces (already refused without capabilities; the filter makes
  it independent of kernel bugs in those checks);
- `bpf`, `perf_event_open`, `userfaultfd`, `io_uring_*`: the largest unprivileged kernel attack surfaces
  (and userfaultfd stalls the kernel at will, a classic exploit primitive);
- host administration: `kexec_*`, `init_module`, `finit_module`, `delete_module`, `reboot`, `swapon`,
  `swapoff`, `acct`, `quotactl*`, `syslog`, `vhangup`, `settimeofday`, `clock_settime`, `clock_adjtime`,
  `adjtimex`, `open_by_handle_at`, `name_to_handle_at`, `lookup_dcookie`, `fanotify_init`, `move_pages`,
  `migrate_pages`, `nfsservctl`, and on x86-64 `iopl`, `ioperm`, `uselib`, `_sysctl`.
A program of another architecture's system-call table (i386 `int 0x80`, the x32 ABI) is killed, so the
numbers cannot be sidestepped. Not covered: everything else (a kernel bug reachable through ordinary calls
such as `read`, `mmap` or `socket` escapes; use a VM boundary for adversarial red-teaming), and
architectures other than x86-64 and aarch64 (there the sandbox runs without a filter and says so in its
notes). Debuggers and tracers (gdb, strace) do not work inside.
"""
from __future__ import annotations

import errno
import os
import platform
import struct

BLOCKED: dict[str, tuple[int | None, int | None]] = {
    # name: (x86-64 number, aarch64 number)
    "add_key": (248, 217), "keyctl": (250, 219), "request_key": (249, 218),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "kcmp": (312, 272),
    "pidfd_getfd": (438, 438), "process_madvise": (440, 440),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "move_mount": (429, 429),
    "open_tree": (428, 428), "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432),
    "fspick": (433, 433), "mount_setattr": (442, 442), "chroot": (161, 51),
    "unshare": (272, 97), "setns": (308, 268),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "reboot": (169, 142), "swapon": (167, 224),
    "swapoff": (168, 225), "acct": (163, 89), "quotactl": (179, 60), "quotactl_fd": (443, 443),
    "syslog": (103, 116), "vhangup": (153, 58), "settimeofday": (164, 170), "clock_settime": (227, 112),
    "clock_adjtime": (305, 266), "adjtimex": (159, 171), "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264), "lookup_dcookie": (212, 18), "fanotify_init": (300, 262),
    "move_pages": (279, 239), "migrate_pages": (256, 238), "nfsservctl": (180, 42),
    "iopl": (172, None), "ioperm": (173, None), "uselib": (134, None), "_sysctl": (156, None),
}
"""System calls refused inside the sandbox, with their numbers per architecture (see the module docstring)."""

_ARCH = {"x86_64": (0xC000003E, 0), "amd64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1),
         "arm64": (0xC00000B7, 1)}  # machine -> (AUDIT_ARCH_*, column in BLOCKED)
_X32_BIT = 0x40000000
_LD_ABS_W, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_RET_ALLOW, _RET_ERRNO, _RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_OFF_NR, _OFF_ARCH = 0, 4  # struct seccomp_data: int nr; __u32 arch; ...


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def supported(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in _ARCH


def program(machine: str | None = None) -> bytes:
    """The filter as the raw `struct sock_filter[]` bubblewrap reads from `--seccomp FD`."""
    machine = (machine or platform.machine()).lower()
    if machine not in _ARCH:
        raise ValueError(f"no seccomp filter for architecture {machine!r}; known: {sorted(_ARCH)}")
    audit, col = _ARCH[machine]
    numbers = sorted({nrs[col] for nrs in BLOCKED.values() if nrs[col] is not None})
    checks = [("jge", _X32_BIT)] if col == 0 else []  # x32 ABI calls carry this bit: refuse them all
    checks += [("jeq", nr) for nr in numbers]
    # layout: ld arch; jeq arch (else kill); ld nr; checks...; ret allow; ret errno; ret kill
    n = len(checks)
    out = [_insn(_LD_ABS_W, _OFF_ARCH), _insn(_JEQ_K, audit, 0, n + 3), _insn(_LD_ABS_W, _OFF_NR)]
    for i, (op, k) in enumerate(checks):
        to_deny = n - i  # past the remaining checks and the allow
        out.append(_insn(_JGE_K if op == "jge" else _JEQ_K, k, to_deny, 0))
    out += [_insn(_RET_K, _RET_ALLOW), _insn(_RET_K, _RET_ERRNO | errno.EPERM), _insn(_RET_K, _RET_KILL_PROCESS)]
    return b"".join(out)


def program_fd(data: bytes) -> int:
    """A pipe's read end holding `data` (bwrap reads the filter to EOF); the caller closes it after the spawn."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(w, view):]
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return r
