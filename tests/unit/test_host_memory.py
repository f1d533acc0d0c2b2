"""The host memory a run may use: the machine's, or less under a cgroup's limit."""

from __future__ import annotations

from pathlib import Path

from distzo.runtime import host_memory
from distzo.runtime.host_memory import available_host_bytes, cgroup_room_bytes

GIB = 1 << 30


def _write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def _proc(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cgroup"
    path.write_text(text)
    return str(path)


def test_cgroup_v2_takes_the_tightest_ancestor_and_counts_inactive_cache_as_free(tmp_path):
    root = tmp_path / "fs"
    _write(root, {})  # the root cgroup has no memory.max
    _write(root / "slurm", {"memory.max": str(8 * GIB), "memory.current": str(3 * GIB)})
    _write(
        root / "slurm" / "job_7",
        {
            "memory.max": "max",
            "memory.current": str(2 * GIB),
            "memory.stat": f"anon 1\ninactive_file {GIB}\n",
        },
    )
    proc = _proc(tmp_path, "0::/slurm/job_7\n")
    # job_7 has no limit; its parent allows 8 GiB and holds 3 GiB (no cache counted)
    assert cgroup_room_bytes(proc, str(root)) == 5 * GIB
    (root / "slurm" / "job_7" / "memory.max").write_text(str(4 * GIB))
    # its own limit: 4 GiB less 2 GiB used, of which 1 GiB is inactive cache
    assert cgroup_room_bytes(proc, str(root)) == 3 * GIB


def test_cgroup_v1_reads_the_hierarchical_limit(tmp_path):
    root = tmp_path / "fs"
    _write(
        root / "memory" / "job",
        {
            "memory.limit_in_bytes": str(1 << 63),
            "memory.usage_in_bytes": str(6 * GIB),
            "memory.stat": f"hierarchical_memory_limit {16 * GIB}\ntotal_inactive_file {2 * GIB}\n",
        },
    )
    proc = _proc(tmp_path, "4:memory:/job\n0::/\n")
    assert cgroup_room_bytes(proc, str(root)) == 12 * GIB


def test_a_containers_own_cgroup_is_its_mount(tmp_path):
    # /proc names the host's path, which does not exist inside the container's mount
    root = tmp_path / "fs"
    _write(root, {"memory.max": str(2 * GIB), "memory.current": str(GIB // 2)})
    proc = _proc(tmp_path, "0::/kubepods/pod1/abc\n")
    assert cgroup_room_bytes(proc, str(root)) == GIB + GIB // 2


def test_no_limit_or_nothing_readable_is_no_reading(tmp_path):
    root = tmp_path / "fs"
    _write(root / "memory", {"memory.limit_in_bytes": "9223372036854771712"})
    _write(root / "memory", {"memory.usage_in_bytes": "100"})
    assert cgroup_room_bytes(_proc(tmp_path, "4:memory:/\n"), str(root)) is None
    assert cgroup_room_bytes(_proc(tmp_path, "0::/\n"), str(tmp_path / "none")) is None
    assert cgroup_room_bytes(str(tmp_path / "no-proc-file"), str(root)) is None
    assert cgroup_room_bytes(_proc(tmp_path, "garbage\n"), str(root)) is None


def test_the_available_memory_is_the_cgroups_room_where_that_is_less(monkeypatch):
    monkeypatch.setattr(host_memory, "_proc_kib", lambda path, field: 4 * GIB)
    monkeypatch.setattr(host_memory, "cgroup_room_bytes", lambda: GIB)
    assert available_host_bytes() == GIB
    monkeypatch.setattr(host_memory, "cgroup_room_bytes", lambda: 8 * GIB)
    assert available_host_bytes() == 4 * GIB
    monkeypatch.setattr(host_memory, "cgroup_room_bytes", lambda: None)
    assert available_host_bytes() == 4 * GIB
