"""`codefleet chaos`: a real training run on a local multi-node Ray cluster while faults are injected at random
times, then the invariants a run must keep checked from its run directory and the machine (docs/reliability.md).

    faults.py      what can be broken, when (a seeded schedule) and how (SIGKILL, a removed node, a full disk)
    invariants.py  what must hold afterwards: finished, nothing accepted lost or trained twice, lag <= eta, no leaks
    soak.py        the cluster, the run (resumed if it dies), the injector loop and the report
"""
