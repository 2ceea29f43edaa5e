"""A rank's command inbox as a run of decode steps watches it (``runtime/scheduler_process.py``'s ``InboxArrivals``):
nothing to report once its commands are taken; its file descriptor readable as soon as the next one arrives."""

from __future__ import annotations

import select

import zmq

from sglang_lite.runtime.scheduler_process import InboxArrivals
from sglang_lite.runtime.transport import pull_socket, push_socket


def test_the_inbox_reports_each_command_that_arrives(tmp_path):
    context = zmq.Context()
    address = f"ipc://{tmp_path}/inbox"
    inbox = pull_socket(context, address)
    sender = push_socket(context, address)
    try:
        arrivals = InboxArrivals(inbox)
        assert not arrivals.waiting() and not arrivals.arrived()
        for n in range(3):
            sender.send(b"command %d" % n)
            # the descriptor turns readable when the message arrives (a bounded wait for that, not a sleep)
            assert select.select([arrivals.fd], [], [], 30.0)[0], "the arrival was not signalled"
            assert arrivals.arrived()
            assert (
                arrivals.waiting()
            )  # read, the events re-arm the descriptor; the command still waits
            assert inbox.recv(zmq.NOBLOCK) == b"command %d" % n
            assert not arrivals.waiting() and not arrivals.arrived()
    finally:
        sender.close(linger=0)
        inbox.close(linger=0)
        context.term()
