"""kccl between two "hosts": two Linux network namespaces joined by a veth
pair (issue 12). Each namespace runs one `torchrun --nnodes=2
--rdzv-backend=c10d` agent with 2 ranks, in its own UTS namespace with its
own hostname, so kccl finds two hosts by itself (hostname + boot id, Note
[kccl across hosts] in torch_kiln/csrc/distributed/CrossHost.h): shared
memory inside each namespace, Gloo over the veth pair between them. Only the
namespaces' own addresses are used (the rendezvous endpoint, --local-addr,
GLOO_SOCKET_IFNAME, and /etc/netns/<ns>/hosts, which `ip netns exec` mounts
on /etc/hosts, naming the two hostnames). The ranks run scenarios of
tests/kccl_worker.py across both: DDP training compared with one process on
the global batch, every collective compared bit for bit with torch on the
CPU, and the basics of DTensor and FSDP2.

Needs root and iproute2 (`ip netns`) and util-linux (`unshare`); skipped with
that reason where the namespaces cannot be created. The fixture removes the
namespaces (after killing every process left in them) and the kccl segments
of the test's processes from /dev/shm, also when the test fails; the run has
a hard timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from kccl_pool import kccl_segments

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)

RUN_TIMEOUT = 240.0  # seconds, both agents together
PORT = 29517          # inside namespace a: nothing else listens there

# Each rank runs scenarios of tests/kccl_worker.py (which compare with one
# process / torch on the CPU in rank order) across the two hosts.
TRAIN_SCRIPT = """
import os, socket, sys
sys.path.insert(0, {tests!r})
import torch, torch.distributed as dist
import torch_kiln.distributed
import kccl_worker as w

torch.kiln.set_device(w.DEVICE)
dist.init_process_group(backend="kccl")
hosts = torch_kiln.distributed.host_layout()
w.s_ddp({{}})                   # DDP, several buckets, vs one process on the global batch
w.s_ddp({{"no_sync": True, "steps": 4}})
w.s_collectives({{}})           # every collective, bit for bit vs the CPU
w.s_dtensor_fsdp({{}})          # DTensor and FSDP2 basics
print(f"KCCL-TWO-HOSTS-OK rank={{dist.get_rank()}} host={{socket.gethostname()}} hosts={{hosts}}", flush=True)
dist.destroy_process_group()
"""


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


class TwoHosts:
    """Namespaces `a` and `b`, addresses 10.213.<n>.1 and .2 on a veth pair."""

    def __init__(self):
        tag = os.getpid() % 100000
        subnet = f"10.213.{tag % 250}"
        self.ns = {"a": f"kccl-{tag}-a", "b": f"kccl-{tag}-b"}
        self.dev = {"a": f"kv{tag}a", "b": f"kv{tag}b"}
        self.addr = {"a": f"{subnet}.1", "b": f"{subnet}.2"}

    def hostname(self, side: str) -> str:
        return f"kccl-host-{side}"

    def create(self) -> None:
        self.made_etc_netns = not os.path.exists("/etc/netns")
        for side in "ab":
            self._check("ip", "netns", "add", self.ns[side])
            # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts on /etc/hosts:
            # the two hostnames resolve to the namespaces' addresses.
            os.makedirs(f"/etc/netns/{self.ns[side]}", exist_ok=True)
            with open(f"/etc/netns/{self.ns[side]}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n")
                for s in "ab":
                    f.write(f"{self.addr[s]} {self.hostname(s)}\n")
        self._check("ip", "link", "add", self.dev["a"], "type", "veth", "peer", "name", self.dev["b"])
        for side in "ab":
            ns, dev = self.ns[side], self.dev[side]
            self._check("ip", "link", "set", dev, "netns", ns)
            self._check("ip", "-n", ns, "addr", "add", f"{self.addr[side]}/24", "dev", dev)
            self._check("ip", "-n", ns, "link", "set", dev, "up")
            self._check("ip", "-n", ns, "link", "set", "lo", "up")

    def remove(self) -> None:
        for side in "ab":
            ns = self.ns[side]
            pids = run("ip", "netns", "pids", ns).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            run("ip", "netns", "del", ns)  # also removes its end of the veth pair
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        if getattr(self, "made_etc_netns", False):
            try:
                os.rmdir("/etc/netns")
            except OSError:
                pass

    @staticmethod
    def _check(*cmd: str) -> None:
        out = run(*cmd)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (ip netns add)")
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} (iproute2 / util-linux; scripts/install_deps.sh installs iproute2)")
    hosts = TwoHosts()
    before = set(kccl_segments())
    try:
        try:
            hosts.create()
        except RuntimeError as e:
            pytest.skip(f"cannot create network namespaces here: {e}")
        yield hosts
    finally:
        hosts.remove()
        # Segments of processes that are gone (SIGKILLed above, or crashed).
        for name in set(kccl_segments()) - before:
            if not os.path.exists(f"/proc/{name.split('-')[1]}"):
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except FileNotFoundError:
                    pass


def agent_command(hosts: TwoHosts, side: str, script: str) -> list[str]:
    torchrun = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=2", "--nproc-per-node=2", "--max-restarts=0",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts.addr['a']}:{PORT}", "--rdzv-id=kccl-two-hosts",
        f"--local-addr={hosts.addr[side]}", script,
    ]
    # Its own hostname (UTS namespace) makes it another host for kccl.
    shell = f'hostname {hosts.hostname(side)} && exec "$@"'
    return ["ip", "netns", "exec", hosts.ns[side], "unshare", "--uts", "sh", "-c", shell, "sh", *torchrun]


# Known bug, issue 12: in earlier runs, about 1 in 5, a non-leader rank
# finished the whole script (it printed KCCL-TWO-HOSTS-OK) and then aborted
# while the interpreter exited ("terminate called without an active
# exception", no Python frame left), so torchrun reported the job failed.
# Since then kccl's completion thread ends before finalization (Note [kccl
# completion thread]) and it was not seen in 36 runs, but the cause was never
# confirmed. One abort with this signature was found and fixed later: the
# autograd device thread freeing the last backward pass's GraphTask while
# Python finalized (Note [Autograd device threads at exit]); whether it was
# this one is not known (12 of 12 runs passed both with and without that
# fix). If it recurs, kiln's terminate report (Note [Reporting
# std::terminate]) in the output below names the thread and its C++
# backtrace. Non-strict: the test runs every time, and its assertions hold
# whenever no rank aborts at exit.
@pytest.mark.xfail(strict=False, reason="issue 12: a rank may abort at interpreter exit after "
                   "finishing (std::terminate in teardown); cause not confirmed")
def test_ddp_across_two_network_namespaces(two_hosts, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    agents = {}
    for side in "ab":
        env = dict(os.environ, KILN_DEVICE_COUNT="2", OMP_NUM_THREADS="1",
                   GLOO_SOCKET_IFNAME=two_hosts.dev[side])
        env.pop("KCCL_HOST_ID", None)
        agents[side] = subprocess.Popen(
            agent_command(two_hosts, side, str(script)), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    deadline = time.monotonic() + RUN_TIMEOUT
    outputs = {}
    timed_out = False
    try:
        for side, proc in agents.items():
            try:
                outputs[side], _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for side, proc in agents.items():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                outputs[side], _ = proc.communicate()
    if timed_out:  # what each agent and its ranks printed, to see where they stopped
        tails = "\n".join(f"--- namespace {s} ---\n{o[-6000:]}" for s, o in outputs.items())
        pytest.fail(f"the torchrun agents did not finish within {RUN_TIMEOUT} s\n{tails}")
    text = "\n".join(f"--- namespace {s} ---\n{o[-4000:]}" for s, o in outputs.items())
    assert [agents[s].returncode for s in "ab"] == [0, 0], text
    found = re.findall(r"KCCL-TWO-HOSTS-OK rank=(\d) host=(\S+) hosts=(\[\[.*?\]\])", text)
    assert sorted(int(r) for r, _, _ in found) == [0, 1, 2, 3], text
    # Two ranks per namespace, each namespace one host for kccl.
    assert {h for _, _, h in found} == {"[[0, 1], [2, 3]]"}, text
    by_host = {}
    for r, host, _ in found:
        by_host.setdefault(host, set()).add(int(r))
    assert sorted(map(sorted, by_host.values())) == [[0, 1], [2, 3]], text
    assert set(by_host) == {"kccl-host-a", "kccl-host-b"}, text
