"""The IPC socket files of the front ends: those a killed front end leaves are removed by the next one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from sglang_lite.runtime import spawn


def _socket_file(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    return sock


def test_files_of_front_ends_that_no_longer_run_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    names = {
        "dead_rank": f"sglang_lite_{dead.pid}_0123abcd_rank0",
        "dead_replies": f"sglang_lite_{dead.pid}_0123abcd_replies",
        "live_rank": f"sglang_lite_{os.getpid()}_89abcdef_rank1",
        "live_replies": f"sglang_lite_{os.getpid()}_89abcdef_replies",
        "other_name": f"sglang_lite_{dead.pid}_0123abcd_other",
    }
    sockets = [_socket_file(str(tmp_path / name)) for name in names.values()]
    not_a_socket = tmp_path / f"sglang_lite_{dead.pid}_fedcba98_rank0"
    not_a_socket.write_text("a user's file")
    try:
        removed = spawn.remove_stale_ipc_files(str(tmp_path))
    finally:
        for sock in sockets:
            sock.close()
    assert sorted(removed) == sorted([names["dead_rank"], names["dead_replies"]])
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(
        [names["live_rank"], names["live_replies"], names["other_name"], not_a_socket.name]
    )


def test_a_new_front_end_clears_them_first(tmp_path, monkeypatch):
    monkeypatch.setattr(spawn.tempfile, "gettempdir", lambda: str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    stale = _socket_file(str(tmp_path / f"sglang_lite_{dead.pid}_0123abcd_replies"))
    stale.close()
    commands, reply = spawn.ipc_addresses(2)
    assert [p.name for p in tmp_path.iterdir()] == []
    assert reply.startswith(f"ipc://{tmp_path}/sglang_lite_{os.getpid()}_")
    assert [c.rsplit("_", 1)[1] for c in commands] == ["rank0", "rank1"]
