"""Where the time of one PD transfer goes, measured on the Mooncake transfer engine alone (no server).

A receiver process registers a buffer, as a decode rank registers its pools; this process writes one request's
worth of bytes into it (`--kv-bytes` of KV, in blocks as a layout would cut them, plus `--state-blocks` GDN state
blocks of `--state-bytes` in all) with `batch_transfer_sync_write`, as `MooncakeTransfer.write` does, and reports
the time per request over `--repeats` writes for each case:

- the number of blocks: the KV in 2 blocks (one run per K and V buffer), in runs of a page of 16 or 64 tokens, and
  one block per token (what a scattered token-granular pool gives);
- batches: the data and the metadata row in one batch against two (the metadata as a second synchronous write);
- contention: a Python thread spinning beside the writer (GIL contention with the forward on the prefill side), and
  the receiver's process spinning (the decode rank's forward on a 2-core host);
- waiting: the engine's synchronous batch write (which waits by spinning on a core) against what the server does,
  `MooncakeTransfer.write` (every block submitted at once, their completion polled with short sleeps).

    python benchmarks/bench_transfer_engine.py
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time

import torch

ROW = 512  # bytes of K + V per token of the built-in tiny model (one full-attention layer, fp32)


def receiver(conn, nbytes: int, spin: bool) -> None:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    engine.register_memory(buffer.data_ptr(), nbytes)
    conn.send((f"127.0.0.1:{engine.get_rpc_port()}", buffer.data_ptr()))
    while not conn.poll(0.001 if not spin else 0):
        if spin:
            sum(range(2000))  # the decode rank's forward, in Python
    conn.recv()


def blocks(
    base_src: int, base_dst: int, tokens: int, run: int, states: int, state_bytes: int
) -> tuple:
    """K and V of ``tokens`` tokens in runs of ``run`` tokens (each run somewhere else on the far side, as in a
    fragmented pool), then ``states`` state blocks."""
    src, dst, lengths = [], [], []
    half = tokens * ROW // 2
    for part in (0, half):
        for start in range(0, tokens, run):
            n = min(run, tokens - start) * ROW // 2
            offset = part + start * ROW // 2
            src.append(base_src + offset)
            dst.append(base_dst + (offset * 7 + 4096) % (4 << 20))  # scattered on the far side
            lengths.append(n)
    each = state_bytes // states
    for i in range(states):
        src.append(base_src + (8 << 20) + i * each)
        dst.append(base_dst + (8 << 20) + i * each)
        lengths.append(each)
    return src, dst, lengths


def write(engine, session: str, src: list, dst: list, lengths: list, batch: int = 1024) -> None:
    for i in range(0, len(src), batch):
        code = engine.batch_transfer_sync_write(
            session, src[i : i + batch], dst[i : i + batch], lengths[i : i + batch]
        )
        assert code == 0, f"write failed ({code})"


def timed(fn, repeats: int) -> dict[str, float]:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return {
        "mean": statistics.fmean(times),
        "p50": times[len(times) // 2],
        "p90": times[int(len(times) * 0.9)],
    }


class Spinner:
    """A Python thread holding the GIL most of the time, as a forward's Python parts do."""

    def __enter__(self) -> Spinner:
        self.stop = False
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()
        return self

    def _spin(self) -> None:
        while not self.stop:
            sum(range(2000))

    def __exit__(self, *exc) -> None:
        self.stop = True
        self.thread.join()


def run_cases(args: argparse.Namespace, spin_receiver: bool) -> list[tuple[str, dict]]:
    from sglang_lite.pd_transport.transfer import MooncakeTransfer

    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=receiver, args=(child, 16 << 20, spin_receiver))
    proc.start()
    session, remote = parent.recv()
    transfer = MooncakeTransfer.start("127.0.0.1", poll=True)  # as on a CPU server
    engine = transfer.engine
    local = torch.ones(16 << 20, dtype=torch.uint8)
    transfer.register([local])
    tokens = args.kv_bytes // ROW
    meta = ([local.data_ptr() + (12 << 20)], [remote + (12 << 20)], [32])
    results = []
    try:
        for label, run in (("per token", 1), ("pages of 16", 16), ("pages of 64", 64)):
            case = blocks(
                local.data_ptr(), remote, tokens, run, args.state_blocks, args.state_bytes
            )
            results.append(
                (
                    f"{label}: {len(case[0])} blocks",
                    timed(lambda c=case: write(engine, session, *c), args.repeats),
                )
            )
        whole = blocks(
            local.data_ptr(), remote, tokens, tokens, args.state_blocks, args.state_bytes
        )
        one = [whole[i] + meta[i] for i in range(3)]
        results.append(
            (
                f"2 KV runs: {len(whole[0])} blocks, meta as a 2nd batch",
                timed(
                    lambda: (write(engine, session, *whole), write(engine, session, *meta)),
                    args.repeats,
                ),
            )
        )
        results.append(
            (
                f"2 KV runs: {len(one[0])} blocks in one batch",
                timed(lambda: write(engine, session, *one), args.repeats),
            )
        )
        results.append(
            ("meta row alone (32 B)", timed(lambda: write(engine, session, *meta), args.repeats))
        )
        results.append(
            (
                f"2 KV runs: {len(whole[0])} blocks, polled (a CPU server's write)",
                timed(lambda: transfer.write(session, *whole), args.repeats),
            )
        )
        with Spinner():
            results.append(
                (
                    f"2 KV runs, one batch, a Python thread spinning beside: {len(one[0])} blocks",
                    timed(lambda: write(engine, session, *one), args.repeats),
                )
            )
            results.append(
                (
                    f"2 KV runs, polled, a Python thread spinning beside: {len(whole[0])} blocks",
                    timed(lambda: transfer.write(session, *whole), args.repeats),
                )
            )
            case = blocks(local.data_ptr(), remote, tokens, 16, args.state_blocks, args.state_bytes)
            results.append(
                (
                    f"pages of 16, a Python thread spinning beside: {len(case[0])} blocks",
                    timed(lambda: write(engine, session, *case), args.repeats),
                )
            )
    finally:
        parent.send("stop")
        proc.join(10)
    return results


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--kv-bytes", type=int, default=1130 * ROW, help="a ~1,000-word prompt's KV")
    p.add_argument("--state-blocks", type=int, default=6)
    p.add_argument("--state-bytes", type=int, default=58368)
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()}")
    for spin in (False, True):
        print(f"\nreceiver process {'spinning' if spin else 'idle'}:")
        for label, t in run_cases(args, spin):
            print(
                f"  {label:<70} mean {t['mean']:7.2f}  p50 {t['p50']:7.2f}  p90 {t['p90']:7.2f} ms"
            )


if __name__ == "__main__":
    main()
