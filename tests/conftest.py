"""Test-session hygiene: nothing the suite starts leaves a file in ``/dev/shm``.

DeepSpeed 0.19.8's CPU shared-memory all-reduce leaves a ~69 MB
``/dev/shm/deepspeed_allreduce_buffer_*`` file per rank per process group (it never unlinks
it).  The suite starts dozens of DeepSpeed process groups, so without cleanup it would fill
RAM-backed tmpfs.  (The main job unlinks its own: ``canzona_ds.integration.runtime_info.
release_shm_buffer``.)

Other people's jobs and test sessions run on the same machine at the same time, so a file
is removed only when it is *abandoned*: no live process maps it (``/proc/*/maps``) and it has
not changed for ``SETTLE_S`` seconds.  The second condition covers the one moment a live
job's buffer is unmapped: DeepSpeed's ``shared_create`` (``shm.cpp``) writes the file and
only then maps it, and the other ranks open it after that; a buffer deleted in between
hangs that job.  Once mapped, a buffer stays mapped until its last process exits.

* session start: the files already in ``/dev/shm`` are remembered (by name and inode) and
  left alone, whoever owns them;
* after a test (at most every ``OLD_SWEEP_EVERY_S``): this user's abandoned DeepSpeed buffers
  that have settled are removed, without waiting for young ones (a wait after each of the
  hundreds of DeepSpeed tests would add up to an hour), so at most the last few seconds'
  buffers are alive at any time;
* session end: every file created during the run that no live process maps is removed
  (DeepSpeed buffers mapped only by this pytest process too: it is exiting); then **the run fails**
  (exit status 1, with a report) if any file created during the run survives that this
  session is responsible for: one it could not remove, or one still mapped by a process the
  suite started (recognised by ``CANZONA_TEST_SESSION`` in its environment, or as a
  descendant of this process).  Files mapped by unrelated live processes are someone
  else's and are not touched.
"""
from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import pytest

from canzona_testkit import kernels, phases

SHM = Path("/dev/shm")
DS_PREFIX = "deepspeed_allreduce_buffer_"
#: seconds an unmapped file must be unchanged before it counts as abandoned
SETTLE_S = float(os.environ.get("CANZONA_SHM_SETTLE_S", "10"))
SESSION_ENV = "CANZONA_TEST_SESSION"

#: the per-test sweep of older buffers runs at most this often
OLD_SWEEP_EVERY_S = 10.0

_session_baseline: set[tuple[str, int]] | None = None
#: DeepSpeed-range tier tests that skipped themselves on a release lacking a feature they need
#: (counted from the reports, where pytest-xdist's workers send them: the controller)
_self_skipped: list[str] = []
SELF_SKIPPED = "skipped itself on a release lacking"
_last_old_sweep = 0.0
_session_report: list[str] = []


# ------------------------------------------------------------------ /dev/shm and /proc
def shm_files(shm: Path = SHM) -> dict[str, os.stat_result]:
    """name -> stat of this user's regular files in ``shm``."""
    out = {}
    try:
        entries = list(os.scandir(shm))
    except OSError:
        return out
    uid = os.getuid()
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if e.is_file(follow_symlinks=False) and st.st_uid == uid:
            out[e.name] = st
    return out


def snapshot(shm: Path = SHM) -> set[tuple[str, int]]:
    """(name, inode) of the files in ``shm`` now: a file recreated under the same name is new."""
    return {(name, st.st_ino) for name, st in shm_files(shm).items()}


def created_since(baseline: set[tuple[str, int]], shm: Path = SHM, prefix: str = "") -> dict[str, os.stat_result]:
    return {name: st for name, st in shm_files(shm).items()
            if name.startswith(prefix) and (name, st.st_ino) not in baseline}


def mappers(shm: Path = SHM) -> dict[tuple[int, int, int], set[int]]:
    """(device major, minor, inode) -> pids of live processes mapping that file of ``shm``.

    By inode, not path: glibc's ``sem_open`` (multiprocessing's named semaphores, ``sem.mp-*``)
    creates the file under a temporary name, maps it and only then links it to its real name,
    so the mapping shows ``/dev/shm/sem.XXXXXX (deleted)``; by path a live semaphore would look
    abandoned, and a session ending beside another one removed it under that one's children."""
    found: dict[tuple[int, int, int], set[int]] = {}
    prefix = f"{shm}/"
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process exited, or is not ours to read
            continue
        pid = int(maps.parent.name)
        for line in text.splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith(prefix):
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                found.setdefault((major, minor, int(parts[4])), set()).add(pid)
    return found


def file_key(st: os.stat_result) -> tuple[int, int, int]:
    """The key :func:`mappers` gives the file ``st`` describes."""
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def _age(st: os.stat_result, now: float) -> float:
    return now - max(st.st_mtime, st.st_ctime)


def sweep(candidates: dict[str, os.stat_result], shm: Path = SHM, wait: bool = True,
          ignore_pids: frozenset[int] = frozenset(), settle_s: float = SETTLE_S) -> list[str]:
    """Remove the abandoned files among ``candidates``: unmapped (mappings by ``ignore_pids``
    do not count) and unchanged for ``settle_s`` seconds.  ``wait``: sleep until a young
    unmapped candidate settles, then decide; otherwise leave it for a later sweep.  Returns
    the names removed."""
    removed: list[str] = []
    pending = dict(candidates)
    if not wait:  # young files would be left anyway: do not scan /proc for them
        now = time.time()
        pending = {n: st for n, st in pending.items() if _age(st, now) >= settle_s}
    while pending:
        mapped = mappers(shm)
        now = time.time()
        young = {}
        for name, st in pending.items():
            path = shm / name
            try:
                cur = path.stat()
            except FileNotFoundError:
                continue
            if cur.st_ino != st.st_ino:
                continue  # another file took the name meanwhile
            if set(mapped.get(file_key(cur), ())) - ignore_pids:
                continue  # a live process uses it
            if _age(cur, now) < settle_s:
                young[name] = cur
                continue
            try:
                path.unlink()
                removed.append(name)
            except FileNotFoundError:
                pass
        if not (wait and young):
            break
        time.sleep(max(0.1, settle_s - min(_age(st, time.time()) for st in young.values())))
        pending = young
    return removed


def _session_pids() -> set[int]:
    """Live processes this session started: ``SESSION_ENV`` in their environment (inherited
    by every child that keeps the environment, also after re-parenting), or descendants of
    this process."""
    token = os.environ.get(SESSION_ENV, "").encode()
    children: dict[int, list[int]] = {}
    ours = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        pid = int(stat.parent.name)
        try:
            fields_ = stat.read_text().rsplit(")", 1)[1].split()
            if fields_[0] == "Z":
                continue
            children.setdefault(int(fields_[1]), []).append(pid)
            if token and f"{SESSION_ENV}=".encode() + token in (stat.parent / "environ").read_bytes().split(b"\0"):
                ours.add(pid)
        except (OSError, IndexError, ValueError):
            continue
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, ()):
            if child not in ours:
                ours.add(child)
                todo.append(child)
    ours.discard(os.getpid())
    return ours


def session_leaks(baseline: set[tuple[str, int]], shm: Path = SHM, settle_s: float = SETTLE_S) -> list[str]:
    """Files created since ``baseline`` this session is responsible for, one line each: settled
    and unmapped (the sweep could not remove it), or mapped by a live process the suite started
    (this process aside: what it maps besides DeepSpeed buffers, e.g. ``sem.mp-*`` of
    multiprocessing queues, its own exit handlers unlink).  An unmapped file younger than
    ``settle_s`` appeared after the sweep: someone else's job starting, not judged."""
    left = created_since(baseline, shm)
    if not left:
        return []
    mapped = mappers(shm)
    ours = _session_pids()
    now = time.time()
    leaks = []
    for name, st in sorted(left.items()):
        pids = mapped.get(file_key(st), set())
        if not pids and _age(st, now) >= settle_s:
            leaks.append(f"{shm / name} ({st.st_size} bytes): unmapped, not removed")
        elif pids & ours:
            leaks.append(f"{shm / name} ({st.st_size} bytes): still mapped by process(es) the suite started: "
                         f"{sorted(pids & ours)}")
    return leaks


# ------------------------------------------------------------------ the DeepSpeed-range tier
#: the integration tier .ci/ds_range runs on the other supported DeepSpeed releases (one node id a line)
DS_RANGE_TIER = Path(__file__).with_name("ds_range_tier.txt")


def ds_range_lines(path: Path = DS_RANGE_TIER) -> dict[str, tuple[str, ...]]:
    """node id -> what it needs: ``needs=<feature>`` (a key of ds_compat.FEATURES: on a release
    without it the test must stop at that feature's refusal), ``bug=<bug>`` (a key of
    ds_compat.KNOWN_BUGS: on a release with that DeepSpeed bug the test is skipped, naming it) or
    ``uses=<module>:<attribute>`` (the test itself, its reference or set-up, relies on that
    DeepSpeed internal: skipped, naming it, on a release without it)."""
    out = {}
    for ln in path.read_text().splitlines():
        if ln.strip() and not ln.lstrip().startswith("#"):
            node, *tags = ln.split()
            out[node] = tuple(tags)
    return out


def _release_gaps(tags: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(features the installed release lacks, why the test is skipped on it) for a tier line's tags."""
    import deepspeed

    from canzona_ds.integration import ds_compat

    lacking, skips = [], []
    for tag in tags:
        kind, _, name = tag.partition("=")
        if kind == "needs" and name in ds_compat.FEATURES:
            if not ds_compat.has(name):
                lacking.append(name)
        elif kind == "bug" and name in ds_compat.KNOWN_BUGS:
            if name in ds_compat.known_bugs():
                fixed, what = ds_compat.KNOWN_BUGS[name]
                skips.append(f"deepspeed=={deepspeed.__version__} has DeepSpeed's bug {name} (fixed in {fixed}): {what}")
        elif kind == "uses" and name.count(":") == 1:
            if not ds_compat._present(*name.split(":")):
                skips.append(f"the test relies on {name.replace(':', '.')}, which deepspeed=="
                             f"{deepspeed.__version__} lacks")
        else:
            raise pytest.UsageError(f"{DS_RANGE_TIER.name}: unknown tag {tag!r}; allowed: needs=<one of "
                                    f"{sorted(ds_compat.FEATURES)}>, bug=<one of {sorted(ds_compat.KNOWN_BUGS)}>, "
                                    "uses=<module>:<attribute>")
    return lacking, skips


def pytest_collection_modifyitems(session, config, items):
    """Mark the tier's tests ``ds_range``; a listed id whose file was collected but which no longer
    exists fails the collection (the list stays the tests it names).  On a release that lacks a
    feature a tier test needs, the test runs and must stop at that feature's refusal by name
    (:func:`pytest_runtest_makereport`); on one with a DeepSpeed bug it names, it is skipped."""

    wanted = ds_range_lines()
    found = set()
    for item in items:
        if item.nodeid in wanted:
            item.add_marker(pytest.mark.ds_range)
            found.add(item.nodeid)
            lacking, skips = _release_gaps(wanted[item.nodeid])
            if skips:
                item.add_marker(pytest.mark.skip(reason="; ".join(skips)))
            elif lacking:
                item.user_properties.append(("canzona_refused", lacking))
    files = {item.nodeid.split("::", 1)[0] for item in items}
    gone = sorted(i for i in set(wanted) - found if i.split("::", 1)[0] in files and "::" in i
                  and not config.getoption("-k") and not any(a.count("::") for a in config.args))
    if gone:
        raise pytest.UsageError(f"{DS_RANGE_TIER.name} lists tests that do not exist: {gone}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A tier test whose setting the installed release refuses: it passes as a skip naming the
    refusal only if it stopped at exactly that refusal (ds_compat.require's line), else it fails."""
    outcome = yield
    lacking = dict(item.user_properties).get("canzona_refused")
    rep = outcome.get_result()
    if not lacking or rep.when == "teardown" or (rep.when == "setup" and rep.passed):
        return  # (a refusal inside a fixture fails the setup: judged there)
    from canzona_ds.integration import ds_compat

    text = rep.longreprtext
    marks = [f"needs deepspeed>={ds_compat.FEATURES[f].since}: {ds_compat.FEATURES[f].why}" for f in lacking]
    if rep.failed and any(m in text for m in marks):
        rep.outcome, rep.longrepr = "skipped", (str(item.path), item.location[1] or 0,
                                                f"Skipped: refused by name as it should be ({', '.join(lacking)})")
    elif rep.skipped:
        # it skipped itself rather than reaching the refusal: said so, and counted at the end
        path, line, reason = rep.longrepr if isinstance(rep.longrepr, tuple) else (str(item.path), 0, text)
        rep.longrepr = (path, line, f"{reason} [{SELF_SKIPPED} {', '.join(lacking)}, before the refusal]")
    else:
        how = "failed otherwise" if rep.failed else rep.outcome
        rep.outcome = "failed"
        rep.longrepr = (f"deepspeed lacks {lacking}: this test should have stopped at that refusal "
                        f"({marks[0]!r}), but it {how}:\n{text}")


# ------------------------------------------------------------------ hooks
def pytest_configure(config):
    global _session_baseline
    kernels.record_exact_assertions()
    if getattr(config, "workerinput", None) is None:  # not an xdist worker
        os.environ.setdefault(SESSION_ENV, f"{os.getpid()}-{time.time_ns()}")
    _session_baseline = snapshot() if SHM.is_dir() else None


@pytest.fixture(autouse=True)
def _release_deepspeed_shm_buffers():
    if not SHM.is_dir():
        yield
        return
    yield
    # Abandoned DeepSpeed buffers that have settled: earlier tests' (this user's, also of a run
    # killed before the session started), at most every OLD_SWEEP_EVERY_S (it scans every
    # process's maps).  Never waiting for a young one to settle here: hundreds of tests start
    # DeepSpeed, and a wait after each would add up to an hour; what the last tests leave is
    # swept at session end, where waiting once is cheap.
    global _last_old_sweep
    if time.time() - _last_old_sweep >= OLD_SWEEP_EVERY_S:
        _last_old_sweep = time.time()
        sweep({n: st for n, st in shm_files().items() if n.startswith(f"{DS_PREFIX}{os.getuid()}_")}, wait=False)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # The pytest process is the reference side of every rank-vs-reference comparison (and both
    # sides of the single-process ones): it runs with the ranks' intra-op thread count
    # (canzona_testkit/dist.py), set before each test's fixtures, so no reference can run with
    # torch's default (the core count) while the ranks run test_threads().  A test marked
    # ``solo`` starts no ranks and takes every core (kernels.threads_for).
    import torch

    torch.set_num_threads(kernels.threads_for(item))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``CANZONA_PHASES`` set: the test's wall and CPU time (canzona_testkit/phases.py)."""
    if not phases.folder():
        yield
        return
    phases.in_ranks[0] = 0.0
    t0, own0, kids0 = time.perf_counter(), phases.cpu_seconds(), phases.cpu_seconds(resource.RUSAGE_CHILDREN)
    yield
    phases.append("tests.jsonl", {"test": item.nodeid, "wall": round(time.perf_counter() - t0, 3),
                                  "cpu": round(phases.cpu_seconds() - own0, 3),
                                  "children_cpu": round(phases.cpu_seconds(resource.RUSAGE_CHILDREN) - kids0, 3),
                                  "in_ranks": round(phases.in_ranks[0], 3),
                                  "outcome": _outcomes.pop(item.nodeid, "passed")})


_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report):
    if report.skipped and SELF_SKIPPED in str(report.longrepr):
        _self_skipped.append(report.nodeid)
    if phases.folder() and (report.failed or (report.skipped and report.when != "teardown")):
        _outcomes.setdefault(report.nodeid, "failed" if report.failed else "skipped")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    kernels.current[0] = item.nodeid
    try:
        return (yield)
    finally:
        kernels.current[0] = None


def pytest_sessionfinish(session, exitstatus):
    kernels.write_log()
    if _session_baseline is None or getattr(session.config, "workerinput", None) is not None:
        return
    # DeepSpeed buffers this process maps too (it is exiting; DeepSpeed never unlinks them)
    sweep(created_since(_session_baseline, prefix=DS_PREFIX), wait=True, ignore_pids=frozenset({os.getpid()}))
    sweep(created_since(_session_baseline), wait=True)
    leaks = session_leaks(_session_baseline)
    _session_report[:] = leaks
    if leaks and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _self_skipped:
        terminalreporter.section("DeepSpeed-range tier: skipped themselves, not refused", sep="=")
        terminalreporter.write_line(f"{len(_self_skipped)} tests skipped themselves on a release lacking a feature "
                                    "they need (not the refusal their tag promises):")
        for nodeid in _self_skipped:
            terminalreporter.write_line(f"  {nodeid}")
    if _session_report:
        terminalreporter.section("/dev/shm files left by this run", sep="=", red=True)
        for line in _session_report:
            terminalreporter.write_line(line)
        terminalreporter.write_line("FAILED: the suite must leave nothing in /dev/shm (tests/conftest.py)")
