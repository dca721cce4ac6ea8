"""A cgroup v2 device program (``BPF_PROG_TYPE_CGROUP_DEVICE``), built and attached from Python.

cgroup v2 has no ``devices.allow`` file: a cgroup's device access is an eBPF program the kernel
runs on every ``open()``/``mknod()`` of a device node by a process of the cgroup (or of a child
with no program of its own). This module assembles that program from an ordered list of rules,
first match wins, the same instruction sequence runc's ``devices`` package and systemd's
``DeviceAllow=`` generate, loads it with the ``bpf()`` system call through ctypes (no libbpf, no
compiler) and attaches it to a cgroup directory.

An attachment made with ``BPF_PROG_ATTACH`` belongs to the cgroup, not to the process that made
it: it outlives the process that attached it (unlike a ``bpf_link``), which is what a device
policy must do when the broker is killed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
import struct
from dataclasses import dataclass

# bpf(2) commands, types and flags (include/uapi/linux/bpf.h).
_BPF_PROG_LOAD = 5
_BPF_PROG_ATTACH = 8
_BPF_PROG_DETACH = 9
_BPF_PROG_QUERY = 16
_BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6
#: A child cgroup may attach a program of its own, which then replaces this one for the child.
BPF_F_ALLOW_OVERRIDE = 1
_BPF_DEVCG_DEV_BLOCK = 1
_BPF_DEVCG_DEV_CHAR = 2
_ACCESS_BITS = {"m": 1, "r": 2, "w": 4}  # BPF_DEVCG_ACC_MKNOD, _READ, _WRITE

_SYSCALL_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351}

# Opcodes (include/uapi/linux/bpf_common.h, bpf.h).
_LDX_MEM_W = 0x61  # BPF_LDX | BPF_MEM | BPF_W
_ALU32_AND_K = 0x54
_ALU32_RSH_K = 0x74
_ALU32_MOV_X = 0xBC
_ALU32_MOV_K = 0xB4
_JMP_JNE_K = 0x55
_JMP_JNE_X = 0x5D
_JMP_JEQ_K = 0x15
_JMP_JGT_K = 0x25  # unsigned
_JMP_JLT_K = 0xA5  # unsigned (Linux 4.14, before device programs: 4.15)
_JMP_EXIT = 0x95
_R0, _R1, _R2, _R3, _R4, _R5 = range(6)


class BpfUnavailable(OSError):
    """The kernel, the architecture or the caller's privileges do not allow device programs."""


@dataclass(frozen=True)
class DeviceRule:
    """One rule: ``allow`` or deny ``kind`` (``c``, ``b`` or ``a`` for both) ``major:minor``
    (``None``: any) for the ``access`` letters of ``rwm``; with ``last``, every minor from
    ``minor`` to ``last`` (one check in a program: a host's thousand MIG capability nodes stay a
    few instructions; cgroup v1 writes one entry per minor, see :meth:`expand`)."""

    allow: bool
    major: int | None
    minor: int | None
    kind: str = "c"
    access: str = "rwm"
    last: int | None = None

    def describe(self) -> str:
        major = "*" if self.major is None else str(self.major)
        minor = "*" if self.minor is None else str(self.minor)
        if self.minor is not None and self.last is not None and self.last != self.minor:
            minor += f"-{self.last}"
        return f"{'allow' if self.allow else 'deny'} {self.kind} {major}:{minor} {self.access}"

    def expand(self) -> list[DeviceRule]:
        """The rule minor by minor (what a cgroup v1 ``devices`` file takes)."""
        if self.minor is None or self.last is None:
            return [self]
        return [DeviceRule(self.allow, self.major, minor, self.kind, self.access) for minor in range(self.minor, self.last + 1)]


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


#: The most instructions a program may have before Linux 5.2 (``BPF_MAXINSNS``), even for root.
MAX_INSNS = 4096


def assemble(rules: list[DeviceRule], default_allow: bool) -> bytes:
    """The program's instructions: the rules in order (first match decides), then the default.

    The context (``struct bpf_cgroup_dev_ctx``) is ``u32 access_type`` (type in the low 16 bits,
    access in the high 16), ``u32 major``, ``u32 minor``.
    """
    program = [
        _insn(_LDX_MEM_W, _R2, _R1, 0),  # R2 = access_type
        _insn(_ALU32_AND_K, _R2, imm=0xFFFF),  # R2 = device type
        _insn(_LDX_MEM_W, _R3, _R1, 0),
        _insn(_ALU32_RSH_K, _R3, imm=16),  # R3 = access wanted
        _insn(_LDX_MEM_W, _R4, _R1, 4),  # R4 = major
        _insn(_LDX_MEM_W, _R5, _R1, 8),  # R5 = minor
    ]
    for rule in rules:
        program.extend(_rule_block(rule))
    program += [_insn(_ALU32_MOV_K, _R0, imm=1 if default_allow else 0), _insn(_JMP_EXIT)]
    return b"".join(program)


def _rule_block(rule: DeviceRule) -> list[bytes]:
    """One rule's checks, each jumping past the rest of the block when it does not match, then
    the verdict and ``exit``."""
    # Each check: its setup, then "jump past the block if it does not match". The access check
    # works on a copy in R1 (the context pointer is no longer needed).
    jumps: list[tuple[list[bytes], int, int, int]] = []  # (setup, opcode, dst|src<<4, imm)
    if rule.kind != "a":
        jumps.append(([], _JMP_JNE_K, _R2, _BPF_DEVCG_DEV_CHAR if rule.kind == "c" else _BPF_DEVCG_DEV_BLOCK))
    mask = sum(_ACCESS_BITS[letter] for letter in set(rule.access))
    if mask != 7:
        setup = [_insn(_ALU32_MOV_X, _R1, _R3), _insn(_ALU32_AND_K, _R1, imm=mask)]
        if rule.allow:  # allows only when every access wanted is in the rule: (R3 & mask) == R3
            jumps.append((setup, _JMP_JNE_X, _R1 | (_R3 << 4), 0))
        else:  # denies when any access wanted is in the rule: (R3 & mask) != 0
            jumps.append((setup, _JMP_JEQ_K, _R1, 0))
    if rule.major is not None:
        jumps.append(([], _JMP_JNE_K, _R4, rule.major))
    if rule.minor is not None and rule.last is not None and rule.last != rule.minor:
        jumps.append(([], _JMP_JLT_K, _R5, rule.minor))
        jumps.append(([], _JMP_JGT_K, _R5, rule.last))
    elif rule.minor is not None:
        jumps.append(([], _JMP_JNE_K, _R5, rule.minor))
    verdict = [_insn(_ALU32_MOV_K, _R0, imm=1 if rule.allow else 0), _insn(_JMP_EXIT)]
    size = sum(len(setup) + 1 for setup, *_ in jumps) + len(verdict)
    block: list[bytes] = []
    for setup, opcode, regs, imm in jumps:
        block.extend(setup)
        skip = size - len(block) - 1  # from the instruction after this jump to the block's end
        block.append(struct.pack("<BBhi", opcode, regs, skip, imm))
    return block + verdict


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _bpf(command: int, attr: bytes) -> int:
    number = _SYSCALL_BPF.get(platform.machine())
    if number is None:
        raise BpfUnavailable(errno.ENOSYS, f"no bpf() system call number known for {platform.machine()}")
    buffer = ctypes.create_string_buffer(attr, len(attr))
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(ctypes.c_long(number), ctypes.c_int(command), buffer, ctypes.c_uint(len(attr)))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(result)


def load(rules: list[DeviceRule], default_allow: bool, name: str = "gpupool_dev") -> int:
    """Load a device program; returns its file descriptor (close it once attached).

    Loaded without the verifier's log: a log of a program of many rules (a host with many MIG
    capability nodes) overflows any buffer and fails the load with ``ENOSPC``. Only a refused
    program is loaded again with the log on, to say why."""
    code = assemble(rules, default_allow)
    try:
        return _load(code, name, 0)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.ENOSYS):
            raise BpfUnavailable(exc.errno, f"cannot load a device program ({exc.strerror})") from exc
        first = exc
    try:
        return _load(code, name, 1)  # the same program again, for the verifier's reason
    except OSError as exc:
        verifier = str(exc.args[1]) if len(exc.args) > 1 and exc.errno == first.errno else ""
        if first.errno == errno.EINVAL and not verifier.strip():
            raise BpfUnavailable(first.errno, f"cannot load a device program ({first.strerror})") from first
        why = f"; {verifier[-400:]}" if verifier.strip() else ""
        raise OSError(first.errno, f"the kernel refused the device program: {first.strerror}{why}") from first


def _load(code: bytes, name: str, log_level: int) -> int:
    """``BPF_PROG_LOAD``; with ``log_level`` 1 a refusal's ``strerror`` is the verifier's log."""
    insns = ctypes.create_string_buffer(code, len(code))
    license_text = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(65536 if log_level else 1)
    attr = struct.pack(
        "<IIQQIIQII16sII",
        _BPF_PROG_TYPE_CGROUP_DEVICE,
        len(code) // 8,
        ctypes.addressof(insns),
        ctypes.addressof(license_text),
        log_level,  # 1: the verifier says why it refused
        len(log) if log_level else 0,
        ctypes.addressof(log) if log_level else 0,
        0,
        0,
        name.encode()[:15],
        0,
        BPF_CGROUP_DEVICE,
    )
    try:
        return _bpf(_BPF_PROG_LOAD, attr.ljust(128, b"\0"))
    except OSError as exc:
        raise OSError(exc.errno, log.value.decode(errors="replace").strip() if log_level else exc.strerror) from None


def attach(cgroup_dir: str, program_fd: int, flags: int) -> None:
    """Attach (or atomically replace, with the same ``flags``) the cgroup's device program."""
    target = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _bpf(_BPF_PROG_ATTACH, struct.pack("<IIIII", target, program_fd, BPF_CGROUP_DEVICE, flags, 0).ljust(128, b"\0"))
    finally:
        os.close(target)


def attach_rules(cgroup_dir: str, rules: list[DeviceRule], default_allow: bool, flags: int) -> None:
    """Load a program for ``rules`` and attach it to ``cgroup_dir`` (replacing its program)."""
    program = load(rules, default_allow)
    try:
        attach(cgroup_dir, program, flags)
    finally:
        os.close(program)


def attached_count(cgroup_dir: str) -> tuple[int, int]:
    """How many device programs sit on this cgroup itself, and their attach flags."""
    target = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        ids = (ctypes.c_uint32 * 4)()
        attr = ctypes.create_string_buffer(
            struct.pack("<IIIIQI", target, BPF_CGROUP_DEVICE, 0, 0, ctypes.addressof(ids), 4).ljust(128, b"\0"), 128
        )
        number = _SYSCALL_BPF.get(platform.machine())
        if number is None:
            raise BpfUnavailable(errno.ENOSYS, f"no bpf() system call number known for {platform.machine()}")
        libc = _libc()
        libc.syscall.restype = ctypes.c_long
        if libc.syscall(ctypes.c_long(number), ctypes.c_int(_BPF_PROG_QUERY), attr, ctypes.c_uint(128)) < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        _, _, _, flags, _, count = struct.unpack_from("<IIIIQI", attr.raw)
        return int(count), int(flags)
    finally:
        os.close(target)


def detach(cgroup_dir: str) -> bool:
    """Remove the cgroup's own device program; False when it had none."""
    target = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _bpf(_BPF_PROG_DETACH, struct.pack("<IIIII", target, 0, BPF_CGROUP_DEVICE, 0, 0).ljust(128, b"\0"))
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return False
        raise
    finally:
        os.close(target)
    return True
