"""A bandwidth-limited two-host link on one machine, for 2-rank benchmarks (needs root).

Two network namespaces joined by a veth pair, egress capped on both ends with ``tc tbf`` (no
``netem`` on these kernels: no added latency); one rank per namespace, pinned to its own core,
with the torchrun variables set, so ``dist.init_process_group("gloo")`` works unchanged.
Everything is removed on every exit path (end, exception, Ctrl-C, SIGTERM).

    sudo python -m benchmarks.netbed --rate 200mbit -- python my_2rank_script.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Link", "run_two_ranks", "two_host_link"]

_NET = "10.213.78"


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def _rate_bits(rate: str) -> int:
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}
    for unit, factor in units.items():
        if rate.lower().endswith(unit):
            return int(float(rate[: -len(unit)]) * factor)
    raise ValueError(f"netbed: rate {rate!r}: use a tc rate like 1gbit, 200mbit, 50mbit, or none")


@dataclass
class Link:
    """The two hosts of a running testbed."""

    ns: tuple[str, str]
    ifname: tuple[str, str]
    ip: tuple[str, str]
    rate: str = "none"

    def set_rate(self, rate: str) -> None:
        """Cap both directions at ``rate`` (``"none"`` removes the cap)."""
        for ns, ifname in zip(self.ns, self.ifname):
            if rate == "none":
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", ifname, "root",
                    check=False)  # fmt: skip
                continue
            # >= 4 ms of traffic, and >= 256 KiB: a smaller bucket splits every packet (a core)
            burst = max(256 * 1024, _rate_bits(rate) // 8 // 250)
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", ifname, "root",
                "tbf", "rate", rate, "burst", str(burst), "latency", "50ms")  # fmt: skip
        self.rate = rate


@contextlib.contextmanager
def two_host_link(rate: str = "none") -> Iterator[Link]:
    """Create the testbed, yield it, and remove it whatever happens."""
    if os.geteuid() != 0:
        raise SystemExit("netbed: needs root (network namespaces, tc qdiscs): run it with sudo")
    tag = os.getpid()
    link = Link(ns=(f"accoA_{tag}", f"accoB_{tag}"), ifname=(f"acA{tag}", f"acB{tag}"),
                ip=(f"{_NET}.1", f"{_NET}.2"))  # fmt: skip
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}

    def interrupted(signum, frame):  # turn SIGTERM/SIGHUP into an exception: cleanup runs
        raise SystemExit(128 + signum)

    for sig in previous:
        signal.signal(sig, interrupted)
    try:
        for ns in link.ns:
            _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", link.ifname[0], "type", "veth", "peer", "name", link.ifname[1])
        for ns, ifname, ip in zip(link.ns, link.ifname, link.ip):
            _sh("ip", "link", "set", ifname, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", ifname)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "link", "set", ifname, "up")
        link.set_rate(rate)
        yield link
    finally:
        for ns in link.ns:
            pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _sh("ip", "netns", "del", ns, check=False)
        for ifname in link.ifname:
            _sh("ip", "link", "del", ifname, check=False)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_two_ranks(link: Link, argv: Sequence[str], env: dict[str, str] | None = None,
                  timeout_s: float = 900, ranks_per_host: int = 1) -> tuple[int, str, str]:  # fmt: skip
    """Run ``argv`` as rank 0 on host A (core 0) and rank 1 on host B (core 1): the first
    non-zero exit status of the two (or 0), rank 0's output, rank 1's output. With
    ``ranks_per_host`` > 1, each host runs that many ranks on its core (host A's first); the
    outputs are each host's first rank's."""
    procs = []
    for host, local in ((h, i) for h in (0, 1) for i in range(ranks_per_host)):
        rank = host * ranks_per_host + local
        rank_env = {
            **os.environ, **(env or {}),
            "RANK": str(rank), "WORLD_SIZE": str(2 * ranks_per_host), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(ranks_per_host),
            "MASTER_ADDR": link.ip[0], "MASTER_PORT": "29621",
            "GLOO_SOCKET_IFNAME": link.ifname[host], "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        cmd = ["ip", "netns", "exec", link.ns[host], "taskset", "-c", str(host), *argv]
        procs.append(subprocess.Popen(cmd, env=rank_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout_s)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    status = next((p.returncode for p in procs if p.returncode), 0)
    return status, outputs[0], outputs[ranks_per_host]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    parser.add_argument("--rate", default="none", help="egress cap of each host: 200mbit, none")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then each rank's command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    with two_host_link(args.rate) as link:
        status, out0, out1 = run_two_ranks(link, command)
    sys.stdout.write(f"--- rank 0 ---\n{out0}--- rank 1 ---\n{out1}")
    sys.exit(status)


if __name__ == "__main__":
    main()
