"""A real heterogeneous cluster on one Linux host (``tapp testbed up`` / ``tapp testbed down``).

Every host of a cluster file becomes a network namespace on a bridge, with a private address and its own sshd;
every device's ``speed`` becomes a CPU quota of the kernel (and cores of its own where there are enough); every
link's bandwidth becomes ``tc`` shaping between the two hosts. The ranks then start as on separate machines:
MPICH's Hydra runs them over ssh on their hosts, inside the hosts' namespaces and quotas, and rank 0 connects back
to the pool over the bridge. Nothing is emulated: the cluster file ``up`` writes says ``emulated: false``.

- ``layout``: what a testbed is made of (hosts, addresses, quotas, shaping), worked out from the cluster file;
- ``bed``: ``up`` and ``down``;
- ``cgroups``, ``shaping``, ``ssh``, ``system``: the kernel's control groups, ``tc``, sshd, and the rest.

It needs root, network namespaces (iproute2), a cpu cgroup controller and sshd (``system.missing`` says what is
missing). Its traffic stays on this machine: the testbed's own addresses, and this machine's bridge address.
"""

from tapp_core.platform.testbed.bed import down, state_folder, up
from tapp_core.platform.testbed.layout import DEFAULT_PREFIX, DEFAULT_SUBNET, TestbedError, TestbedLayout, plan_testbed
from tapp_core.platform.testbed.system import missing

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_SUBNET",
    "TestbedError",
    "TestbedLayout",
    "down",
    "missing",
    "plan_testbed",
    "state_folder",
    "up",
]
