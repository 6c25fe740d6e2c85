"""rloo_engine.services: the one free-port, /health and process-group helper every server starter uses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from rloo_engine.services import ServiceExited, free_port, group_alive, kill_process_group, wait_for_health


def test_a_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert free_port("0.0.0.0") > 0


def test_health_wait_stops_at_once_when_the_process_is_gone_and_times_out_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    start = time.monotonic()
    with pytest.raises(ServiceExited, match=url):
        wait_for_health(url, 30, running=lambda: False)
    assert time.monotonic() - start < 5
    with pytest.raises(TimeoutError, match=rf"{url} was not healthy after 1 s"):
        wait_for_health(url, 1, poll_s=0.2)


def test_a_zombie_does_not_keep_a_group_alive_and_a_group_is_killed_whole():
    # a group leader that forks a child and exits without reaping it: the child exits too and stays a zombie
    # until init reaps it; a sleeping grandchild keeps the group alive until it is killed
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                               "time.sleep(60)"], start_new_session=True)
    time.sleep(1.0)
    assert group_alive(leader.pid)
    kill_process_group(leader.pid, 5, leader=leader)
    assert not group_alive(leader.pid)
    assert leader.returncode is not None


def test_group_alive_ignores_an_unreaped_leader():
    child = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # exited, not yet waited for: a zombie
        with open(f"/proc/{child.pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    assert not group_alive(child.pid)
    os.waitpid(child.pid, 0)
