"""The soak's fault machinery that needs root: network namespaces (link cuts) and a small disk (disk full).

What:
- `Hosts`: the run's brokers and launcher in one network namespace ("brk", its own bridge and address), and a
  rollout host and a reward host, each in its own namespace joined to that bridge by a veth pair. Only the
  network is separate (every namespace sees the same filesystem, so the soak reads every process's events).
  `cut(host)` sets the brokers' end of the host's veth pair down (the cable pulled), `heal(host)` up again.
  Every link lives inside namespaces made here: nothing touches the root namespace's interfaces, and `close()`
  deletes the namespaces (and so the bridge and veths) whatever happened.
- `SmallDisk`: a tmpfs of `size_mb` mounted on the run directory (the disk quota); `fill()` writes a file until
  the disk is full (ENOSPC) and `free()` deletes it; `close()` unmounts.
- `root_unavailable(...)`: why a kind cannot run here (not root, no `ip`, namespaces or mounts refused), or None.
Why apart from soak.py: the nemesis and the audit stay readable there; this is plumbing.

    sudo python benchmarks/faults/soak.py --minutes 5 --interval 10 20      (link_cut and disk_full need root)
"""
from __future__ import annotations

import errno
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from areal_mq.testing.netns import ip as _ip, netns_unavailable  # noqa: F401 (netns_unavailable: soak.py asks here)



def mount_unavailable() -> str | None:
    """Why this machine cannot mount a small tmpfs as the run directory's disk (None when it can)."""
    if sys.platform != "linux":
        return "tmpfs mounts are Linux only"
    if os.geteuid() != 0:
        return "needs root to mount a size-limited tmpfs on the run directory"
    probe = Path(tempfile.mkdtemp(prefix="soak-mount-probe-"))
    try:
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)], capture_output=True,
                              text=True, timeout=20)
        if made.returncode != 0:
            return f"`mount -t tmpfs` failed: {made.stderr.strip()}"
        subprocess.run(["umount", str(probe)], capture_output=True, timeout=20)
        return None
    finally:
        probe.rmdir()


class Hosts:
    """The brokers' namespace with a bridge, and one namespace per outside host on it (see the module doc)."""

    def __init__(self) -> None:
        self.prefix = f"amqs{secrets.token_hex(2)}"  # unique per run: two runs never share a name
        self.subnet = self._free_subnet()
        self.brk = f"{self.prefix}-brk"
        self.brk_addr = f"{self.subnet}.1"
        self.hosts: dict[str, str] = {}  # name -> its namespace
        self.veths: dict[str, str] = {}  # name -> the brokers' end of its cable
        self._made: list[str] = []

    @staticmethod
    def _free_subnet() -> str:
        used = _ip("-4", "addr").stdout + _ip("-4", "route").stdout
        for _ in range(100):
            subnet = f"10.78.{secrets.randbelow(250) + 1}"
            if f"{subnet}." not in used:
                return subnet
        raise RuntimeError("no free 10.78.X.0/24 subnet")

    def up(self, names: tuple[str, ...]) -> None:
        _ip("netns", "add", self.brk)
        self._made.append(self.brk)
        br = f"{self.prefix}b"
        _ip("-n", self.brk, "link", "add", br, "type", "bridge")
        _ip("-n", self.brk, "addr", "add", f"{self.brk_addr}/24", "dev", br)
        _ip("-n", self.brk, "link", "set", br, "up")
        _ip("-n", self.brk, "link", "set", "lo", "up")
        for i, name in enumerate(names):
            ns, outer, inner = f"{self.prefix}-{name}", f"{self.prefix}{i}o", f"{self.prefix}{i}i"
            _ip("netns", "add", ns)
            self._made.append(ns)
            # both ends made straight inside the namespaces: the root namespace never sees them
            _ip("-n", self.brk, "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
            _ip("-n", self.brk, "link", "set", outer, "master", br, "up")
            _ip("-n", ns, "addr", "add", f"{self.subnet}.{i + 2}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.hosts[name], self.veths[name] = ns, outer

    def exec_prefix(self, name: str | None) -> list[str]:
        """The command prefix that runs a process in host `name`'s namespace (None: the brokers')."""
        return ["ip", "netns", "exec", self.hosts[name] if name else self.brk]

    def cut(self, name: str) -> None:
        _ip("-n", self.brk, "link", "set", self.veths[name], "down")

    def heal(self, name: str) -> None:
        _ip("-n", self.brk, "link", "set", self.veths[name], "up")

    def close(self) -> None:
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)  # takes its veth ends (and, for brk, the bridge) with it
        self._made.clear()


class SmallDisk:
    """A tmpfs of `size_mb` on `path` (the run directory): the disk the disk_full fault fills."""

    def __init__(self, path: Path, size_mb: int):
        self.path, self.size_mb, self.mounted = path, size_mb, False
        self.filler = path / ".soak-disk-fill"

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m,mode=0755", "tmpfs", str(self.path)],
                       check=True, capture_output=True, timeout=20)
        self.mounted = True

    def usage(self) -> dict:
        st = os.statvfs(self.path)
        total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        return {"size_mb": round(total / 2**20, 1), "used_mb": round((total - free) / 2**20, 1),
                "free_mb": round(free / 2**20, 1)}

    def fill(self) -> int:
        """Write until the disk is full; returns the bytes written (the run's processes now meet ENOSPC)."""
        written, block = 0, 1 << 20
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while block >= 512:
                try:
                    written += os.write(fd, b"\0" * block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    block //= 2  # the last blocks: down to nothing left
        finally:
            os.close(fd)
        return written

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self, keep: Path | None = None) -> None:
        """Unmount (copying the run directory to `keep` first, when given: a tmpfs forgets it)."""
        if not self.mounted:
            return
        self.free()
        if keep is not None:
            shutil.copytree(self.path, keep, symlinks=True, dirs_exist_ok=True)
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=60)
        self.mounted = False


class PublishedChecksums:
    """The checksums the trainer published for each version, read from run_dir/weights/vN while the run goes on
    (a version dir lives only until `trainer.keep_weight_versions` newer ones exist): the full file's manifest
    (safetensors metadata "checksums") or the delta's (metadata "delta": every tensor's resulting checksum).
    A version published twice (redone after the trainer resumed from a checkpoint) keeps both variants."""

    def __init__(self, weights_dir: Path):
        self.dir = weights_dir
        self.by_version: dict[int, list[dict[str, str]]] = {}
        self._seen: set[tuple[int, int]] = set()  # (version, inode of its directory)

    def scan(self) -> None:
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        for name in names:
            if not (name.startswith("v") and name[1:].isdigit()):
                continue
            path = self.dir / name
            try:
                key = (int(name[1:]), path.stat().st_ino)
            except OSError:
                continue  # pruned meanwhile
            if key in self._seen:
                continue
            sums = self._read(path)
            if sums is not None:
                self._seen.add(key)
                variants = self.by_version.setdefault(key[0], [])
                if sums not in variants:
                    variants.append(sums)

    @staticmethod
    def _read(path: Path) -> dict[str, str] | None:
        import json

        for fname in ("model.safetensors", "model.delta"):
            try:
                with open(path / fname, "rb") as f:
                    size = int.from_bytes(f.read(8), "little")
                    meta = json.loads(f.read(size)).get("__metadata__") or {}
            except (OSError, ValueError):
                continue
            if "checksums" in meta:
                return dict(json.loads(meta["checksums"]))
            if "delta" in meta:
                return {t["name"]: t["checksum"] for t in json.loads(meta["delta"])["tensors"]}
        return None

    def check(self, version: int, engine: dict[str, str]) -> str:
        """'verified', 'wrong' (some published tensor differs or is missing) or 'unverifiable' (not seen)."""
        variants = self.by_version.get(version)
        if not variants:
            return "unverifiable"
        ok = any(all(engine.get(name) == digest for name, digest in v.items()) for v in variants)
        return "verified" if ok else "wrong"
