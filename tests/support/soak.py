"""The fault-injection soak: collective prefetches under ``mpirun -n 4`` while the
origin, the disks, the pools and the ranks misbehave, with the pool invariants
checked after every round.

The driver owns a :class:`~distcache.testing.LoopbackOrigin` and the pool
directories; the ranks (:mod:`tests.soak.worker`) run rounds it posts through files
in a control directory. A job (one ``mpirun``) runs ``clean, fault, clean, fault,
...``; a SIGKILL fault ends its job and the next job starts with a clean round (half
the SIGKILL jobs run with ``--enable-recovery``, so the survivors must leave on their
own, by their timeout). About a third of the fault rounds are "lazy": ranks read
through ``pool.fetch`` (the per-object download lock) and then ``sync``. Pool
layouts rotate per job: two simulated nodes (``DISTCACHE_NODE_ID`` per MPMD part),
one pool per rank, one pool shared by all. One pool of each layout lives on a small
tmpfs (when the driver may mount one) so that "disk full" is a real ``ENOSPC``.

After every round, from the driver:

* hang: every rank reported (or, after a kill, the job exited) within
  ``DISTCACHE_TIMEOUT`` + slack, else the process group is killed and counted;
* corrupt served: ``pool.get`` of every object returns bytes that hash to its name
  (ranks check the same after each successful round);
* partial: nothing under ``objects/`` but whole, verifying objects; temporary files
  only in ``tmp/``, and none at all after a round no process was killed in;
* lost: every object that verified before the round and was not deliberately
  deleted or corrupted still verifies after it (gc is off);
* a clean round downloads exactly the objects missing from every pool: the origin's
  request count equals that number, and every rank succeeds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distcache import Artifact, ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts
from tests.support.process import mpirun

__all__ = ["FAULT_KINDS", "SoakConfig", "SoakResult", "run_soak", "tmpfs_available"]

ROOT = Path(__file__).resolve().parents[2]
#: The rank program, run as a module (``PYTHONPATH`` names the checkout; see ``_env``).
WORKER = "tests.soak.worker"

#: Every kind of fault a round may draw.
FAULT_KINDS = (
    "origin_500",
    "origin_429",
    "origin_timeout",
    "origin_truncate",
    "origin_wrong_bytes",
    "origin_hang",
    "disk_full",
    "corrupt_objects",
    "delete_objects",
    "stale_files",
    "sigkill",
)
LAYOUTS = ("nodes", "per_rank", "shared")
RANKS = 4
_TMPFS_BYTES = 2 << 20
_STALE_AGE_S = 2 * 3600


@dataclass(frozen=True)
class SoakConfig:
    """How long and how hard to soak."""

    #: Fault rounds to run (each followed by a clean round).
    rounds: int
    #: Seed of every random choice; the same seed replays the same schedule.
    seed: int
    #: Scratch directory (pools, origin files, control files).
    workdir: Path
    #: Artifacts in the universe; a fault round prefetches a subset.
    artifacts: int = 10
    min_size: int = 2_000
    max_size: int = 40_000
    #: DISTCACHE_TIMEOUT, DISTCACHE_HTTP_TIMEOUT, DISTCACHE_HTTP_RETRIES for the ranks.
    timeout: float = 8.0
    http_timeout: float = 1.0
    http_retries: int = 2
    #: Seconds past ``timeout`` a round may take before it counts as a hang.
    slack: float = 15.0
    #: Fault rounds per mpirun job at most (a SIGKILL round ends its job early).
    rounds_per_job: int = 12
    #: Share of fault rounds that kill a rank (each costs an mpirun start).
    kill_share: float = 0.15
    #: Share of fault rounds that fetch lazily through ``pool.fetch`` and then sync.
    lazy_share: float = 0.3
    #: Mount a tmpfs for the full-disk fault: None = when running as root.
    tmpfs: bool | None = None
    #: Keep the scratch directory for inspection.
    keep: bool = False


@dataclass
class SoakResult:
    seed: int
    rounds: int = 0
    clean_rounds: int = 0
    jobs: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    #: Fault rounds by outcome: ok, failed (PrefetchError everywhere), killed.
    outcomes: Counter[str] = field(default_factory=Counter)
    hangs: int = 0
    corrupt_served: int = 0
    #: Deliberately corrupted objects that a read found and quarantined.
    corrupt_detected: int = 0
    lost: int = 0
    partial: int = 0
    tmp_leaks: int = 0
    clean_failures: int = 0
    #: Origin requests in clean rounds, and the objects missing from every pool then.
    clean_requests: int = 0
    clean_expected: int = 0
    violations: list[str] = field(default_factory=list)
    #: The longest any rank spent in one round (a survivor's wait for a dead peer
    #: is bounded by DISTCACHE_TIMEOUT per collective).
    slowest_round_s: float = 0.0
    #: Rounds after which a rank waited for downloads a timed-out prefetch left running.
    settled_stray_downloads: int = 0
    tmpfs: bool = False
    seconds: float = 0.0

    def ok(self) -> bool:
        return not self.violations and self.hangs == 0 and self.corrupt_served == 0 \
            and self.lost == 0 and self.partial == 0 and self.clean_failures == 0

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["faults"] = dict(sorted(self.faults.items()))
        out["outcomes"] = dict(sorted(self.outcomes.items()))
        out["ok"] = self.ok()
        return out

    def table(self) -> str:
        rows = [
            ("seed", self.seed), ("fault rounds", self.rounds),
            ("clean rounds", self.clean_rounds), ("mpirun jobs", self.jobs),
            *((f"  fault {k}", v) for k, v in sorted(self.faults.items())),
            *((f"  outcome {k}", v) for k, v in sorted(self.outcomes.items())),
            ("hangs", self.hangs), ("corrupt served", self.corrupt_served),
            ("corrupt detected (deliberate)", self.corrupt_detected),
            ("objects lost", self.lost), ("partial objects visible", self.partial),
            ("temp files leaked", self.tmp_leaks),
            ("clean rounds failed", self.clean_failures),
            ("clean origin requests / expected", f"{self.clean_requests} / {self.clean_expected}"),
            ("slowest rank-round (s)", f"{self.slowest_round_s:.1f}"),
            ("rounds that settled stray downloads", self.settled_stray_downloads),
            ("violations", len(self.violations)), ("tmpfs full-disk", self.tmpfs),
            ("seconds", f"{self.seconds:.1f}"),
        ]
        width = max(len(str(k)) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def tmpfs_available() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


@contextlib.contextmanager
def _tmpfs(path: Path, wanted: bool) -> Iterator[bool]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = False
    if wanted:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={_TMPFS_BYTES}", "tmpfs",
                               str(path)], capture_output=True, check=False)
        mounted = done.returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def _env(config: SoakConfig) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
        PYTHONDONTWRITEBYTECODE="1",
        DISTCACHE_TIMEOUT=str(config.timeout),
        DISTCACHE_HTTP_TIMEOUT=str(config.http_timeout),
        DISTCACHE_HTTP_RETRIES=str(config.http_retries),
        DISTCACHE_DOWNLOADS_PER_RANK="2",
        DISTCACHE_FLASHINFER="0",
        DISTCACHE_LOCK_TIMEOUT=str(config.timeout / 2),
    )
    env.pop("DISTCACHE_POOL_MAX_BYTES", None)  # gc would make "lost" meaningless
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


class _Soak:
    def __init__(self, config: SoakConfig, work: Path, tmpfs_dir: Path | None,
                 log: Callable[[str], None]) -> None:
        self.config = config
        self.work = work
        self.tmpfs_dir = tmpfs_dir
        self.log = log
        self.rng = random.Random(config.seed)
        self.result = SoakResult(seed=config.seed, tmpfs=tmpfs_dir is not None)
        self.origin_dir = work / "origin"
        self.universe = make_artifacts(self.origin_dir, config.artifacts,
                                       min_size=config.min_size, max_size=config.max_size,
                                       seed=config.seed)
        self.server = LoopbackOrigin(self.origin_dir)
        self.env = _env(config)
        self.round = 0
        #: pool root -> shas that verified there after the last check
        self.verified: dict[str, set[str]] = {}
        self.layout_pools = {layout: self._pools(layout) for layout in LAYOUTS}

    # -- layout -----------------------------------------------------------------------

    def _pools(self, layout: str) -> list[str]:
        base = self.work / "pools" / layout
        full = self.tmpfs_dir / layout if self.tmpfs_dir is not None else base / "small"
        if layout == "nodes":  # ranks 0,1 on node "a"; 2,3 on node "b" (on the tmpfs)
            return [str(base / "a"), str(base / "a"), str(full), str(full)]
        if layout == "per_rank":
            return [str(base / "r0"), str(base / "r1"), str(base / "r2"), str(full)]
        return [str(full)] * RANKS

    # -- schedule ---------------------------------------------------------------------

    def schedule(self) -> list[str]:
        kinds = [k for k in FAULT_KINDS if k != "sigkill"]
        if self.tmpfs_dir is None:
            kinds.remove("disk_full")
        kills = max(1, round(self.config.rounds * self.config.kill_share))
        plain: list[str] = []
        while len(plain) < self.config.rounds - kills:
            batch = kinds[:]
            self.rng.shuffle(batch)
            plain.extend(batch)
        plan = plain[: self.config.rounds - kills] + ["sigkill"] * kills
        rest = plan[1:]
        self.rng.shuffle(rest)
        return plan[:1] + rest

    # -- one job ----------------------------------------------------------------------

    def run(self) -> SoakResult:
        start = time.monotonic()
        plan = self.schedule()
        jobs: list[list[str]] = [[]]
        for kind in plan:
            jobs[-1].append(kind)
            if kind == "sigkill" or len(jobs[-1]) >= self.config.rounds_per_job:
                jobs.append([])
        layouts = list(LAYOUTS)
        try:
            for index, kinds in enumerate(j for j in jobs if j):
                layout = layouts[index % len(layouts)] if index < len(layouts) \
                    else self.rng.choice(layouts)
                self._job(layout, kinds)
            # A last job of one clean round checks the state the final fault left.
            self._job(self.rng.choice(layouts), [])
        finally:
            self.server.stop()
        self.result.seconds = time.monotonic() - start
        return self.result

    def _job(self, layout: str, kinds: list[str]) -> None:
        pools = self.layout_pools[layout]
        control = Path(tempfile.mkdtemp(prefix="job-", dir=self.work))
        (control / "job.json").write_text(json.dumps({
            "origin": self.server.url, "pool_of_rank": pools, "first_round": self.round,
            "idle_s": self.config.timeout * 4 + 60,
        }))
        for root in set(pools):
            ArtifactPool(root)  # create before the ranks race to
            self._check(root, set(), set(), expect_no_tmp=False)
        # MPMD: ranks 0-1 are node "a", ranks 2-3 node "b".
        part = [sys.executable, "-m", WORKER, str(control)]
        # With --enable-recovery mpirun does not tear the job down when a rank dies,
        # so the survivors must get out by themselves, within their timeout.
        recovery = bool(kinds) and kinds[-1] == "sigkill" and self.rng.random() < 0.5
        cmd = [mpirun(), "--oversubscribe", *(["--enable-recovery"] if recovery else []),
               "-n", "2", "-x", "DISTCACHE_NODE_ID=a", *part,
               ":", "-n", "2", "-x", "DISTCACHE_NODE_ID=b", *part]
        out = open(control / "job.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.result.jobs += 1
        self.log(f"job {self.result.jobs}: layout {layout}, faults {kinds}")
        try:
            alive = self._clean(proc, control, pools)
            for kind in kinds:
                if not alive:
                    break
                alive = self._fault(proc, control, pools, kind, recovery)
                if alive and kind != "sigkill":
                    alive = self._clean(proc, control, pools)
            if alive:
                self._post(control, {"stop": True})
                self.round += 1
                self._wait_exit(proc, control, "stop")
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.close()
        self.round += 1  # never reuse a round number the dead job might still read

    def _post(self, control: Path, spec: dict[str, Any]) -> None:
        path = control / f"round-{self.round}.json"
        tmp = control / f".round-{self.round}.tmp"
        tmp.write_text(json.dumps(spec))
        os.replace(tmp, path)

    def _deadline(self) -> float:
        return time.monotonic() + self.config.timeout + self.config.slack

    def _collect(self, proc: subprocess.Popen[bytes], control: Path) -> list[dict[str, Any]] | None:
        """Every rank's report of the current round; None when the job died or hung."""
        deadline = self._deadline()
        k = self.round
        while True:
            found = [control / f"done-{k}-{r}.json" for r in range(RANKS)]
            if all(p.exists() for p in found):
                return [json.loads(p.read_text()) for p in found]
            if proc.poll() is not None:
                self._violation(f"round {k}: job exited (rc {proc.returncode}) before every "
                                f"rank reported; see {control / 'job.log'}")
                return None
            if time.monotonic() > deadline:
                missing = [r for r, p in enumerate(found) if not p.exists()]
                self.result.hangs += 1
                self._violation(f"round {k}: ranks {missing} hung past "
                                f"{self.config.timeout + self.config.slack:g}s")
                os.killpg(proc.pid, signal.SIGKILL)
                return None
            time.sleep(0.01)

    def _wait_exit(self, proc: subprocess.Popen[bytes], control: Path, why: str) -> None:
        try:
            proc.wait(timeout=self.config.timeout + self.config.slack)
        except subprocess.TimeoutExpired:
            self.result.hangs += 1
            self._violation(f"round {self.round}: job did not exit after {why} within "
                            f"{self.config.timeout + self.config.slack:g}s")

    def _violation(self, text: str) -> None:
        self.result.violations.append(f"[seed {self.config.seed}] {text}")
        self.log(f"VIOLATION {text}")

    # -- rounds -----------------------------------------------------------------------

    def _spec(self, artifacts: list[Artifact]) -> dict[str, Any]:
        return {"artifacts": [[a.name, a.sha256, a.size] for a in artifacts]}

    def _clean(self, proc: subprocess.Popen[bytes], control: Path, pools: list[str]) -> bool:
        roots = sorted(set(pools))
        expected = sum(
            1 for a in self.universe if not any(a.sha256 in self.verified[r] for r in roots)
        )
        self.server.reset()
        self._post(control, self._spec(self.universe))
        reports = self._collect(proc, control)
        self.result.clean_rounds += 1
        k = self.round
        self.round += 1
        if reports is None:
            self.result.clean_failures += 1
            return False
        requests = self.server.total_requests
        self.result.clean_requests += requests
        self.result.clean_expected += expected
        self._tally_served(reports, pools, set())
        bad = [r for r in reports if not r["ok"]]
        if bad:
            self.result.clean_failures += 1
            self._violation(f"clean round {k} failed: {bad[0].get('message')}")
        elif requests != expected or reports[0]["downloads"] != expected:
            self.result.clean_failures += 1
            self._violation(f"clean round {k}: {requests} origin requests and "
                            f"{reports[0]['downloads']} downloads; expected {expected}")
        for root in roots:
            self._check(root, set(), set(), expect_no_tmp=True)
            lacking = [a.name for a in self.universe if a.sha256 not in self.verified[root]]
            if not bad and lacking:
                self._violation(f"clean round {k}: pool {root} lacks {lacking[:3]}")
        return not any(r.get("comm_broken") for r in reports)

    def _fault(self, proc: subprocess.Popen[bytes], control: Path, pools: list[str],
               kind: str, recovery: bool = False) -> bool:
        rng = self.rng
        roots = sorted(set(pools))
        kinds = [kind]
        if kind != "sigkill" and rng.random() < 0.3:
            extra = rng.choice([k for k in FAULT_KINDS if k not in ("sigkill", kind)])
            if extra != "disk_full" or self.tmpfs_dir is not None:
                kinds.append(extra)
        for k in kinds:
            self.result.faults[k] += 1
        self.result.rounds += 1
        chosen = rng.sample(self.universe, rng.randint(3, len(self.universe)))
        deleted: set[tuple[str, str]] = set()
        corrupted: set[tuple[str, str]] = set()
        # Evict a few of the round's objects everywhere, so the origin is needed.
        for a in rng.sample(chosen, rng.randint(1, min(3, len(chosen)))):
            for root in roots:
                if self._remove(root, a.sha256):
                    deleted.add((root, a.sha256))
        self.server.reset()
        planted: list[Path] = []
        ballast: Path | None = None
        for k in kinds:
            if k.startswith("origin_"):
                self._inject(k, chosen)
            elif k == "disk_full":
                ballast = self._fill_disk()
            elif k == "corrupt_objects":
                for root in rng.sample(roots, rng.randint(1, len(roots))):
                    present = sorted(s for s in self.verified[root] if (root, s) not in deleted)
                    for sha in rng.sample(present, min(len(present), rng.randint(1, 3))):
                        self._corrupt(root, sha)
                        corrupted.add((root, sha))
            elif k == "delete_objects":
                for root in rng.sample(roots, rng.randint(1, len(roots))):
                    present = sorted(s for s in self.verified[root] if (root, s) not in deleted)
                    for sha in rng.sample(present, min(len(present), rng.randint(1, 3))):
                        if self._remove(root, sha):
                            deleted.add((root, sha))
            elif k == "stale_files":
                planted += self._plant(rng.choice(roots))
        if kind == "sigkill" and rng.random() < 0.7:
            # Slow downloads, so that the kill lands in the middle of the fetch phase.
            self.server.inject("latency", None, rng.randint(1, 4), seconds=0.4)
        spec = self._spec(chosen)
        if rng.random() < self.config.lazy_share:
            spec["mode"] = "lazy"
            self.result.outcomes["lazy_rounds"] += 1
        self._post(control, spec)
        killed = False
        if kind == "sigkill":
            victim = rng.randrange(RANKS)
            killed = self._kill(control, victim)
            self._post_stop_after_kill(control)
            if recovery:
                self._survivors(proc, control, victim)
            self._wait_exit(proc, control, "SIGKILL")
            reports = None
        else:
            reports = self._collect(proc, control)
        if ballast is not None:
            ballast.unlink()
        self.round += 1
        if reports is not None:
            self._tally_served(reports, pools, corrupted)
            unexpected = [r for r in reports if r.get("unexpected")]
            if unexpected:
                self._violation(f"fault round {self.round - 1} ({kinds}): rank "
                                f"{unexpected[0]['rank']} raised {unexpected[0]['error']}: "
                                f"{unexpected[0]['message']}")
            oks = {r["ok"] for r in reports}
            if len(oks) > 1:
                self._violation(f"fault round {self.round - 1} ({kinds}): ranks disagree "
                                f"on the outcome: {[r.get('error') for r in reports]}")
            self.result.outcomes["ok" if all(oks) else "failed"] += 1
        for path in planted:  # old ones must have been swept by the ranks' pool open
            stale = time.time() - path.stat().st_mtime > _STALE_AGE_S / 2 if path.exists() \
                else False
            if stale:
                self._violation(f"stale file {path} survived a pool open")
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        for root in roots:
            self._check(root, deleted, corrupted, expect_no_tmp=not killed)
        return reports is not None and not any(r.get("comm_broken") for r in reports)

    def _tally_served(self, reports: list[dict[str, Any]], pools: list[str],
                      corrupted: set[tuple[str, str]]) -> None:
        if any(r.get("settle_seconds", 0.0) > 0.05 for r in reports):
            self.result.settled_stray_downloads += 1
        for r in reports:
            self.result.slowest_round_s = max(self.result.slowest_round_s, r["seconds"])
            self.result.corrupt_served += int(r.get("corrupt_served", 0))
            # Only an object corrupted in place (presence is trusted) may be missing.
            missing = [s for s in r.get("missing_after_ok", ())
                       if (pools[r["rank"]], s) not in corrupted]
            if missing:
                self._violation(f"round {self.round - 1}: rank {r['rank']} succeeded but "
                                f"{len(missing)} object(s) are not in its pool")

    # -- faults -----------------------------------------------------------------------

    def _inject(self, kind: str, chosen: list[Artifact]) -> None:
        rng = self.rng
        path = rng.choice(chosen).name if rng.random() < 0.6 else None
        count = rng.randint(1, self.config.http_retries + 2)
        if kind == "origin_500":
            self.server.inject("500", path, count)
        elif kind == "origin_429":
            self.server.inject("429", path, count, retry_after=0.05)
        elif kind == "origin_timeout":
            self.server.inject("latency", path, count, seconds=self.config.http_timeout * 1.5)
        elif kind == "origin_truncate":
            self.server.inject("truncate", path, count, fraction=rng.random())
        elif kind == "origin_wrong_bytes":
            self.server.inject("wrong_bytes", path, count)
        elif kind == "origin_hang":
            self.server.inject("hang", path, count, seconds=self.config.http_timeout * 2.5)

    def _fill_disk(self) -> Path | None:
        assert self.tmpfs_dir is not None
        ballast = self.tmpfs_dir / "ballast"
        free = os.statvfs(self.tmpfs_dir)
        room = free.f_bavail * free.f_frsize
        leave = self.rng.randint(0, self.config.max_size)
        with open(ballast, "wb") as f, contextlib.suppress(OSError):  # ENOSPC: as full as it gets
            f.write(b"\0" * max(0, room - leave))
        return ballast

    def _corrupt(self, root: str, sha: str) -> None:
        path = Path(root) / "objects" / sha[:2] / sha
        mode = path.stat().st_mode
        os.chmod(path, 0o644)
        data = bytearray(path.read_bytes())
        how = self.rng.choice(("flip", "truncate", "empty", "grow"))
        if how == "flip" and data:
            data[self.rng.randrange(len(data))] ^= 0x5A
        elif how == "truncate":
            data = data[: len(data) // 2]
        elif how == "empty":
            data = bytearray()
        else:
            data += b"junk"
        path.write_bytes(bytes(data))
        os.chmod(path, mode & 0o7777)

    @staticmethod
    def _remove(root: str, sha: str) -> bool:
        try:
            os.unlink(Path(root) / "objects" / sha[:2] / sha)
            return True
        except FileNotFoundError:
            return False

    def _plant(self, root: str) -> list[Path]:
        old = time.time() - _STALE_AGE_S
        files = []
        for i, sha in enumerate(self.rng.sample(self.universe, 2)):
            tmp = Path(root) / "tmp" / f"{sha.sha256[:16]}.deadhost.{99000 + i}.0badc0ffee.tmp"
            tmp.write_bytes(b"partial download by a killed process")
            os.utime(tmp, (old, old))
            lock = Path(root) / "locks" / f"{sha.sha256}.lock"
            lock.touch()
            os.utime(lock, (old, old))
            files += [tmp, lock]
        return files

    def _kill(self, control: Path, victim: int) -> bool:
        time.sleep(self.rng.uniform(0.0, 0.3))
        try:
            pid = json.loads((control / f"pid-{victim}.json").read_text())["pid"]
            os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            self.result.outcomes["kill_missed"] += 1
            return False
        when = "after" if (control / f"done-{self.round}-{victim}.json").exists() else "during"
        self.result.outcomes[f"killed_{when}_round"] += 1
        self.log(f"round {self.round}: killed rank {victim} (pid {pid}) {when} the round")
        return True

    def _post_stop_after_kill(self, control: Path) -> None:
        # Survivors that finish the round (with an error) find a stop order next.
        self.round += 1
        self._post(control, {"stop": True, "peer_killed": True})
        self.round -= 1

    def _survivors(self, proc: subprocess.Popen[bytes], control: Path, victim: int) -> None:
        """Under --enable-recovery: each survivor must report within its timeout."""
        deadline = self._deadline()
        k = self.round
        waiting = {r for r in range(RANKS) if r != victim}
        while waiting and time.monotonic() < deadline:
            waiting = {r for r in waiting if not (control / f"done-{k}-{r}.json").exists()}
            time.sleep(0.01)
        if waiting:
            self.result.hangs += 1
            self._violation(f"round {k}: survivors {sorted(waiting)} of a killed rank did not "
                            f"report within {self.config.timeout + self.config.slack:g}s")
            return
        done = [json.loads((control / f"done-{k}-{r}.json").read_text())
                for r in range(RANKS) if r != victim]
        outcomes = {d.get("error") for d in done}
        self.result.slowest_round_s = max(self.result.slowest_round_s,
                                          *(d["seconds"] for d in done))
        self.result.outcomes["survivors_" + "_".join(sorted(str(o) for o in outcomes))] += 1

    # -- checks -----------------------------------------------------------------------

    def _check(self, root: str, deleted: set[tuple[str, str]],
               corrupted: set[tuple[str, str]], *, expect_no_tmp: bool) -> None:
        base = Path(root)
        objects = base / "objects"
        before = self.verified.get(root, set())
        # Partial objects: anything under objects/ that is not a whole, named object.
        names: list[str] = []
        for dirpath, _dirs, files in os.walk(objects):
            for name in files:
                prefix = os.path.basename(dirpath)
                if len(name) != 64 or name[:2] != prefix:
                    self.result.partial += 1
                    self._violation(f"stray file {os.path.join(dirpath, name)} in objects/")
                else:
                    names.append(name)
        tmp_files = sorted(p.name for p in (base / "tmp").iterdir()) if (base / "tmp").exists() \
            else []
        if expect_no_tmp and tmp_files:
            self.result.tmp_leaks += len(tmp_files)
            self._violation(f"round {self.round - 1}: temp files left in {base / 'tmp'}: "
                            f"{tmp_files[:3]}")
        for name in tmp_files:  # a killed writer's leftovers: remove, as a sweep later would
            with contextlib.suppress(FileNotFoundError):
                (base / "tmp" / name).unlink()
        pool = ArtifactPool(root)
        good: set[str] = set()
        for sha in names:
            data = pool.get(sha)
            if data is None:
                if (root, sha) in corrupted:
                    self.result.corrupt_detected += 1
                elif os.path.exists(objects / sha[:2] / sha):
                    self._violation(f"object {sha} in {root} unreadable")
                else:
                    self.result.partial += 1
                    self._violation(f"object {sha} in {root} failed verification "
                                    "without being corrupted on purpose")
            elif hashlib.sha256(data).hexdigest() != sha:
                self.result.corrupt_served += 1
                self._violation(f"pool.get({sha}) in {root} returned other bytes")
            else:
                good.add(sha)
        spared = {s for s in before if (root, s) not in deleted and (root, s) not in corrupted}
        lost = spared - good
        if lost:
            self.result.lost += len(lost)
            self._violation(f"round {self.round - 1}: {len(lost)} object(s) lost from {root}")
        self.verified[root] = good


def run_soak(config: SoakConfig, log: Callable[[str], None] | None = None) -> SoakResult:
    """Run the soak described by ``config`` and return its figures."""
    config.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="soak-", dir=config.workdir))
    wanted = tmpfs_available() if config.tmpfs is None else config.tmpfs
    try:
        with _tmpfs(work / "fs", wanted) as mounted:
            soak = _Soak(config, work, work / "fs" if mounted else None, log or (lambda _m: None))
            return soak.run()
    finally:
        if not config.keep:
            subprocess.run(["rm", "-rf", str(work)], check=False)
