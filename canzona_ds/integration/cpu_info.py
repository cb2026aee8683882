"""py-cpuinfo's answer, computed once per machine instead of once per call in every rank.

DeepSpeed asks ``cpuinfo.get_cpu_info()`` whenever it loads a CPU op: the op builder's
``cpu_arch()`` and ``simd_width()`` (both, for every JIT load of FusedAdam or CPUAdam on the
CPU accelerator) and ``DeepSpeedCPUAdam.__init__`` (ZeRO-Offload).  Each call starts a new
Python interpreter (``cpuinfo.py --json``), which starts another process to run CPUID and
sleeps one second in it to measure the clock: about 1.3 s of wall time and 1 s of CPU per call,
three calls per offloaded rank, paid by every rank of every job at start-up.  The answer
depends only on the machine's processor.

:func:`install` wraps ``cpuinfo.get_cpu_info`` (the module attribute DeepSpeed imports at each
call) so that the first call on a machine writes its answer to a file, and every later call, in
any process of this user, reads that file:

    <TORCH_EXTENSIONS_DIR>/cpuinfo/<key>.json   (canzona_ds.op_cache_dir() unless set: beside the
                                                JIT-built ops)

``<key>`` is a hash of what identifies the processor in ``/proc/cpuinfo`` (vendor, model name,
family/model/stepping, flags) and the logical CPU count: a home folder shared by machines of
different kinds (NFS) gives each kind its own file.  The file is written atomically (a
temporary file renamed), so concurrent first calls from several ranks at most compute it
twice.  Any failure to read or write the cache falls back to py-cpuinfo itself; a process where
``/proc/cpuinfo`` cannot be read is not cached at all.  ``CANZONA_CPUINFO_CACHE=0`` turns the
cache off.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os

ENV = "CANZONA_CPUINFO_CACHE"
#: the /proc/cpuinfo fields that identify the processor (the first logical CPU's block)
_IDENTIFYING = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")


def machine_key(proc_cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """A short hash naming this machine's processor, or None when ``/proc/cpuinfo`` is unreadable."""
    try:
        with open(proc_cpuinfo) as f:
            text = f.read()
    except OSError:
        return None
    first = text.split("\n\n", 1)[0]
    fields = {}
    for line in first.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in _IDENTIFYING:
            fields[name.strip()] = value.strip()
    if not fields:
        return None
    fields["logical cpus"] = str(os.cpu_count())
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def cache_path() -> str | None:
    """``<TORCH_EXTENSIONS_DIR>/cpuinfo/<machine key>.json`` (``import canzona_ds`` sets the folder:
    its op cache), or None: no machine key, or no op cache folder named."""
    key, ops = machine_key(), os.environ.get("TORCH_EXTENSIONS_DIR")
    return None if key is None or not ops else os.path.join(ops, "cpuinfo", f"{key}.json")


def cached(get_cpu_info):
    """``get_cpu_info`` answered from the machine's cache file, computing and writing it once."""

    @functools.wraps(get_cpu_info)
    def get_cpu_info_cached():
        path = cache_path()
        if path is not None:
            try:
                with open(path) as f:
                    info = json.load(f)
                if isinstance(info, dict) and info:
                    return info
            except (OSError, ValueError):
                pass
        info = get_cpu_info()
        if path is not None and isinstance(info, dict) and info:  # py-cpuinfo answers {} on failure
            tmp = f"{path}.{os.getpid()}.tmp"
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(tmp, "w") as f:
                    json.dump(info, f)
                os.replace(tmp, path)
            except OSError:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        return info

    get_cpu_info_cached._canzona_cached = True
    return get_cpu_info_cached


def install() -> bool:
    """Route ``cpuinfo.get_cpu_info`` through the machine's cache (idempotent).  False when
    py-cpuinfo is not installed or ``CANZONA_CPUINFO_CACHE=0``."""
    if os.environ.get(ENV, "1") == "0":
        return False
    try:
        import cpuinfo
    except ImportError:
        return False
    if not getattr(cpuinfo.get_cpu_info, "_canzona_cached", False):
        cpuinfo.get_cpu_info = cached(cpuinfo.get_cpu_info)
    return True
